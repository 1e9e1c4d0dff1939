# Debian's prometheus as docker-compose.yml's prometheus service runs the official image: the server as the
# entrypoint (compose passes its flags), its data in /prometheus, run as nobody; its web pages' templates with the
# JavaScript and fonts they load (Debian ships these apart); wget for the healthcheck is in the offline base.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
# The tag names the upstream version; this label Debian's, its revision included (which security update).
ARG DEBIAN_VERSION
LABEL grpo-offline.debian-version="${DEBIAN_VERSION}"
COPY usr/bin/prometheus usr/bin/promtool /usr/bin/
COPY usr/share/prometheus /usr/share/prometheus/
COPY usr/share/javascript /usr/share/javascript/
COPY usr/share/fonts /usr/share/fonts/
USER nobody
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
