#!/usr/bin/env bash
# Check the deployment files without a cluster or a container engine:
#   render every overlay with kubectl's built-in kustomize, validate every document
#   against the Kubernetes schemas in strict mode (kubernetes-validate, offline), and
#   lint the Dockerfiles with hadolint. The pytest suites (tests/test_k8s_manifests.py,
#   tests/test_dockerfiles.py) check the project's own rules on top of this.
# Usage: scripts/k8s-validate.sh [KUBERNETES_VERSION ...]   (default: 1.30.0 and newest)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${VENV:-.venv}/bin
command -v kubectl >/dev/null || { echo "kubectl not found" >&2; exit 2; }
[ -x "$BIN/kubernetes-validate" ] || { echo "$BIN/kubernetes-validate missing: pip install -e '.[dev]'" >&2; exit 2; }
versions=("$@")
if [ ${#versions[@]} -eq 0 ]; then
  versions=(1.30.0 "$("$BIN/python" -c 'import kubernetes_validate as k; print(k.latest_version())')")
fi
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
for overlay in k8s/overlays/*/; do
  name=$(basename "$overlay")
  kubectl kustomize "$overlay" > "$out/$name.yaml"
  for v in "${versions[@]}"; do
    "$BIN/kubernetes-validate" --strict --quiet --kubernetes-version "$v" "$out/$name.yaml"
    echo "ok  $name: $(grep -c '^kind:' "$out/$name.yaml") documents valid for Kubernetes $v (strict)"
  done
done
"$BIN/hadolint" docker/Dockerfile.cpu docker/Dockerfile.cuda
echo "ok  hadolint: docker/Dockerfile.cpu docker/Dockerfile.cuda"
