"""The OpenAI-compatible HTTP door (`POST /v1/chat/completions`, `GET /v1/models`): requests
mapped onto the gateway's one pipeline (gateway/core.py), answers mapped back.

`mapping` turns a request body into a `ChatRequest` and events into OpenAI objects,
`errors` gives every refusal OpenAI's error shape, `app` is the Starlette application, and
`listener` serves it with uvicorn on the gateway's event loop, bounded.
"""
