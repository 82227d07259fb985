"""What mmrag's two HTTP services share, the REST API (serving/api/) and the vision service (serving/vision/):
the error envelope and its handlers (errors.py: every error JSON with its cause and fix, no host path shown) and
the bodies they document it and their health checks with (schemas.py). Neither service imports the other."""
