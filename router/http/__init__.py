"""The router's OpenAI-compatible HTTP API (FastAPI + uvicorn on the router's event loop, server-sent
events for streams), a second front end beside the gRPC API that takes the same internal path
(:meth:`router.server.Router.generate`)::

    server.py   HttpFrontEnd: binds, serves and stops uvicorn; the served model name
    app.py      routes, the bearer-token and body-size guard, streaming and non-streaming answers
    schemas.py  request bodies (strict, unknown fields refused)
    mapping.py  body -> GenerateRequest (the one place), refused parameters
    reply.py    the router's messages -> OpenAI JSON and stream chunks (reasoning, content, tool calls)
    chat.py     messages -> prompt ids through the chat template (model/chat_template.py)
    streams.py  the choices of one request run together, cancelled when the client goes
    errors.py   router statuses -> HTTP statuses, errors in OpenAI's shape
"""
