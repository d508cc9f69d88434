# syntax=docker/dockerfile:1
#
# The queueguard operator image: a release build on Debian 12 (bookworm), run on distroless
# cc-debian12 (same glibc, CA certificates included, no shell) as the nonroot user 65532.
#
#   docker build -t ghcr.io/queueguard/queueguard:0.1.0 .
#
# TLS is rustls with ring, so no OpenSSL is needed at build or run time; the system CA bundle
# (/etc/ssl/certs) is what amqps:// and https:// brokers are verified against unless a policy's
# Secret supplies `caCert`.

# The crate is edition 2024: Rust 1.85 or later.
ARG RUST_VERSION=1

FROM rust:${RUST_VERSION}-bookworm AS builder
WORKDIR /build
ENV CARGO_TERM_COLOR=never \
    CARGO_INCREMENTAL=0 \
    CARGO_PROFILE_RELEASE_STRIP=debuginfo

# Dependencies first, against placeholder sources, so this layer is rebuilt only when
# Cargo.toml or Cargo.lock change and not on every source edit.
COPY Cargo.toml Cargo.lock ./
# Cargo.toml names the benchmarks' sources, which must exist for any build.
COPY benches ./benches
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    mkdir src \
    && echo 'fn main() {}' > src/main.rs \
    && touch src/lib.rs \
    && cargo build --release --locked --bin queueguard \
    && rm -rf src target/release/queueguard target/release/deps/queueguard-* \
       target/release/deps/libqueueguard-* target/release/.fingerprint/queueguard-*

# The operator itself. touch: the copied sources may be older than the placeholder build.
COPY src ./src
RUN --mount=type=cache,target=/usr/local/cargo/registry,sharing=locked \
    touch src/main.rs src/lib.rs \
    && cargo build --release --locked --bin queueguard \
    && ./target/release/queueguard --version

FROM gcr.io/distroless/cc-debian12:nonroot

ARG VERSION=0.1.0
ARG REVISION=""
LABEL org.opencontainers.image.title="queueguard" \
      org.opencontainers.image.description="Kubernetes operator that keeps RabbitMQ queues and their messages safe across consumer rollouts" \
      org.opencontainers.image.source="https://github.com/queueguard/queueguard" \
      org.opencontainers.image.url="https://github.com/queueguard/queueguard" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"

COPY --from=builder /build/target/release/queueguard /queueguard

USER 65532:65532
# 8080: /metrics, /healthz, /readyz. 9443: the optional mutating webhook (HTTPS).
EXPOSE 8080 9443
ENTRYPOINT ["/queueguard"]
CMD ["run"]
