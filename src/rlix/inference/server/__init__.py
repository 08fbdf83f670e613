"""The engine server: one engine behind vLLM's HTTP API.

app.py (the FastAPI app and its ASGI fast paths), serving.py (data plane), control.py (control
plane), openai_schema.py (data-plane wire shapes), control_schema.py (control-plane bodies),
paths.py (the routes other layers name).
"""
