"""The REST service: a thin FastAPI app over the RAG pipeline, one router per resource."""
