"""The socket layer both KV backends share: frames, the listening receiver, the HMAC handshake,
the sending channel, and the table of pending transfers."""
