"""The engine server: one engine behind vLLM's HTTP API.

app.py (the FastAPI app and its ASGI fast paths), requests.py (requests -> validated Jobs), serving.py (data plane:
Jobs on the engine, answers whole or streamed), text_stream.py (detokenising as samples grow), control.py (control
plane), openai_schema.py (data-plane wire shapes), control_schema.py (control-plane bodies),
paths.py (the routes other layers name), responses_*.py (/v1/responses: the translation to chat completions, its
streamed events, the bounded response store, the endpoint shared with the router).
"""
