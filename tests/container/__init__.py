"""docker/Dockerfile built with buildah on a local Debian base, and the image run with podman."""
