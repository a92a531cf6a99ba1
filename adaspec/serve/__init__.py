"""OpenAI-compatible HTTP server (`adaspec serve`): FastAPI on uvicorn, engine in its own thread."""
