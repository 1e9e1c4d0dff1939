# Debian's redis-server (in the offline base, from Debian's archive) as docker-compose.yml's redis service runs the
# official image: the data in /data (owned by the redis user, so the volume Docker makes from it is Redis's), the
# server started by compose's script, which drops root for the redis user with setpriv (the official image's
# entrypoint does it with gosu).
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
# The tag names the upstream version; this label Debian's, its revision included (which security update).
ARG DEBIAN_VERSION
LABEL grpo-offline.debian-version="${DEBIAN_VERSION}"
WORKDIR /data
VOLUME /data
EXPOSE 6379
CMD ["redis-server"]
