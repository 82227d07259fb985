"""Scale-out on Ray Serve (`mmrag serve --ray`): engine replicas with image-prefix-affinity routing, the vision
service beside them. Only the --ray path imports this package; its modules import Ray lazily or not at all,
except the request router (serving/ray/router.py), which subclasses Ray's."""
