"""mmrag: multimodal RAG that reuses image-prefix KV on purpose. The CLI lives in mmrag.cli."""
