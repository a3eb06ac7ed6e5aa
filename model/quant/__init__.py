"""Weight and activation quantization: INT4 weight-only (``int4``) for decode, FP8 W8A8 (``fp8``) for prefill.

Two phases, as in gpt-fast's ``quantize.py``: an offline ``create_quantized_state_dict()``
and a runtime ``convert_for_runtime()`` that swaps ``nn.Linear`` modules in place.
"""
