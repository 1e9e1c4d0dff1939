# Debian's prometheus as docker-compose.yml's prometheus service runs the official image: the server as the
# entrypoint (compose passes its flags), its data in /prometheus, run as nobody; wget for the healthcheck is in the
# offline base.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}
COPY usr/bin/prometheus usr/bin/promtool /usr/bin/
USER nobody
WORKDIR /prometheus
VOLUME /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
