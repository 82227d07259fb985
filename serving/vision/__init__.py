"""The vision feature service (`mmrag vision serve`): app.py routes, batcher.py batches, metrics.py exports."""
