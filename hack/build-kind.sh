#!/usr/bin/env bash
# kind and a kind node image built here (issue 25): no registry is reachable, so nothing is pulled.
# Prints a directory holding `kind`, `kubectl`, node-image.env (NODE_IMAGE=...) and the node image
# as a `docker save` archive (node-image.tar, loaded again when Docker's data root is new).
#
# What kind's own `build node-image` does, from parts built here, at the control plane's versions:
#   kind          sigs.k8s.io/kind (KIND_VERSION), built from its module;
#   base          debootstrap of Debian bookworm with what kind's base image installs (systemd,
#                 iptables, conntrack, ...; runc and the CNI plugins from Debian's packages), plus
#                 kind's own node files (entrypoint, systemd units, containerd config) read from
#                 kind's module; containerd, its shim and ctr from hack/build-node.sh; crictl from
#                 sigs.k8s.io/cri-tools;
#   Kubernetes    kubeadm, kubelet, kubectl in /usr/bin, and the images kubeadm runs, preloaded
#                 into the node's containerd: kube-apiserver, -controller-manager, -scheduler and
#                 -proxy (same module workspace as the control plane), etcd (ETCD_VERSION), CoreDNS
#                 (the version kubeadm names, from github.com/coredns/coredns), the pause image.
# Not built: kindnetd, whose module no proxy serves; the node has a bridge CNI configuration of
# its own instead (one node: nothing to route between nodes), and the cluster is created with
# `networking.disableDefaultCNI` (hack/e2e-kind.sh). Storage is kind's: the local-path provisioner
# (github.com/rancher/local-path-provisioner), as the default StorageClass.
# runc inside the node is hack/kind/runc-wrapper (no CAP_SYS_RESOURCE on this machine), and
# containerd restricts oom_score_adj for the same reason.
set -euo pipefail

# shellcheck source=lib.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/lib.sh"
log() { echo "[build-kind] $*" >&2; }
# Docker answers (and has the runtime kind's nodes need) even when everything below is cached.
bash "$here/dockerd.sh"
cp_bin="$(bash "$here/build-control-plane.sh")"
node_bin="$(bash "$here/build-node.sh")"
# One build at a time (make test's and make e2e-kind's may overlap): the second finds the first's.
mkdir -p "$cache/kind"
exec 9>"$cache/kind/.lock"
flock 9
# The recipe: this script, its files, the pinned versions, the scripts that build its parts, and
# the binaries they made (their directories are named by the versions they were built at).
recipe_sum="$({ cat "$here/build-kind.sh" "$here/kind/"* "$here/versions.env" "$here/lib.sh" "$here/build-node.sh" \
  "$here/build-control-plane.sh"; echo "$cp_bin $node_bin"; go version; } | sha256sum | cut -c1-12)"
use_cached_output "$cache/kind/${KUBERNETES_VERSION}_kind-${KIND_VERSION}_${recipe_sum}"
NODE_IMAGE="tether.local/kind-node:${KUBERNETES_VERSION}-${recipe_sum}"
# The binaries do not change with the recipe: cached apart, by version.
bin="$cache/kind/bin-${KUBERNETES_VERSION}_kind-${KIND_VERSION}_cri-tools-${CRI_TOOLS_VERSION}"
mkdir -p "$bin"
ln -sfn "$bin" "$out/bin"

(
  kubernetes_workspace
  for b in kubeadm kube-proxy; do
    [[ -x "$bin/$b" ]] && continue
    log "building $b ${KUBERNETES_VERSION}"
    go build -p "${TETHER_BUILD_PARALLELISM:-2}" -trimpath -ldflags "$k8s_ldflags" -o "$bin/$b.tmp" "k8s.io/kubernetes/cmd/$b" >&2
    mv "$bin/$b.tmp" "$bin/$b"
  done
)
[[ -x "$bin/kind" ]] || { log "building kind ${KIND_VERSION}"
  build_go_binary "$cache/src/kind-${KIND_VERSION}" "sigs.k8s.io/kind@${KIND_VERSION}" "$bin/kind" sigs.k8s.io/kind; }
[[ -x "$bin/crictl" ]] || { log "building crictl ${CRI_TOOLS_VERSION}"
  build_go_binary "$cache/src/cri-tools-${CRI_TOOLS_VERSION}" "sigs.k8s.io/cri-tools@${CRI_TOOLS_VERSION}" "$bin/crictl" \
    sigs.k8s.io/cri-tools/cmd/crictl; }
[[ -x "$bin/local-path-provisioner" ]] || { log "building local-path-provisioner ${LOCAL_PATH_PROVISIONER_VERSION}"
  build_go_binary "$cache/src/local-path-provisioner-${LOCAL_PATH_PROVISIONER_VERSION}" \
    "github.com/rancher/local-path-provisioner@${LOCAL_PATH_PROVISIONER_VERSION}" "$bin/local-path-provisioner" \
    github.com/rancher/local-path-provisioner; }
cp "$cp_bin/kubectl" "$bin/kubectl"

# The images kubeadm asks for at this version; etcd is the control plane's own (ETCD_VERSION), which
# hack/e2e-kind.sh names in kubeadm's configuration.
images="$("$bin/kubeadm" config images list --kubernetes-version "$KUBERNETES_VERSION")"
coredns_image="$(grep /coredns <<<"$images")"
coredns_version="${coredns_image##*:}"
etcd_image="registry.k8s.io/etcd:${ETCD_VERSION#v}-0"
[[ -x "$bin/coredns" ]] || { log "building CoreDNS ${coredns_version}"
  build_go_binary "$cache/src/coredns-${coredns_version}" "github.com/coredns/coredns@${coredns_version}" "$bin/coredns" \
    github.com/coredns/coredns; }

# Images from one static binary each (a `docker import` of a one-file tree, as distroless would
# hold it); kube-proxy also needs iptables and conntrack, so it sits on the node's own base.
# Scratch space outside the cached directory: a build killed midway leaves nothing in it.
image_dir="$(mktemp -d "$cache/kind/tmp.XXXXXX")"
build="tether-kind-build-$$"
trap 'docker rm -f "$build" >/dev/null 2>&1 || true; rm -rf "$image_dir"' EXIT
one_binary_image() {  # TAG BINARY PATH-IN-IMAGE
  local tree
  tree="$(mktemp -d "$image_dir/tree.XXXXXX")"
  install -D -m 0755 "$2" "$tree$3"
  mkdir -p "$tree/tmp" && chmod 1777 "$tree/tmp"
  tar -C "$tree" --owner=0 --group=0 -cf - . | docker import --change "ENTRYPOINT [\"$3\"]" \
    --change 'ENV PATH=/usr/local/bin:/usr/bin:/bin' - "$1" >&2
}
k8s=registry.k8s.io
for b in kube-apiserver kube-controller-manager kube-scheduler; do
  one_binary_image "$k8s/$b:${KUBERNETES_VERSION}" "$cp_bin/$b" "/usr/local/bin/$b"
done
one_binary_image "$etcd_image" "$cp_bin/etcd" /usr/local/bin/etcd
one_binary_image "$coredns_image" "$bin/coredns" /coredns
# kind's containerd configuration names this sandbox image.
sandbox_image="$(sed -n 's/^ *sandbox_image = "\(.*\)"/\1/p' "$(go mod download -json "sigs.k8s.io/kind@${KIND_VERSION}" \
  | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')/images/base/files/etc/containerd/config.toml")"
one_binary_image "$sandbox_image" "$node_bin/pause" /pause
# kind's default storage: the local-path provisioner with its own install manifest (from its
# module; its StorageClass made the default, as kind's is), and its helper image ("busybox", the
# one the manifest names): Debian's static busybox with its applets.
storage_manifest="$(go mod download -json "github.com/rancher/local-path-provisioner@${LOCAL_PATH_PROVISIONER_VERSION}" \
  | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')/deploy/local-path-storage.yaml"
provisioner_image="docker.io/$(sed -n 's/^ *image: \(rancher\/local-path-provisioner:.*\)$/\1/p' "$storage_manifest")"
helper_image="docker.io/library/$(sed -n 's/^ *image: \(busybox\)$/\1/p' "$storage_manifest"):latest"
[[ "$provisioner_image" == */local-path-provisioner:* && "$helper_image" == */busybox:latest ]] \
  || { log "the provisioner's manifest names other images: $provisioner_image $helper_image"; exit 1; }
one_binary_image "$provisioner_image" "$bin/local-path-provisioner" /usr/local/bin/local-path-provisioner
[[ -x /bin/busybox ]] && /bin/busybox --list >/dev/null 2>&1 || apt_install busybox-static
busybox_tree="$(mktemp -d "$image_dir/busybox.XXXXXX")"
install -D -m 0755 /bin/busybox "$busybox_tree/bin/busybox"
for applet in $(/bin/busybox --list); do [[ "$applet" == busybox ]] || ln -s busybox "$busybox_tree/bin/$applet"; done
mkdir -p "$busybox_tree/tmp" && chmod 1777 "$busybox_tree/tmp"
tar -C "$busybox_tree" --owner=0 --group=0 -cf - . | docker import --change 'CMD ["sh"]' \
  --change 'ENV PATH=/bin' - "$helper_image" >&2

# The base: Debian with the packages kind's base image installs. Its rootfs is cached by package list.
packages=systemd,dbus,conntrack,iptables,nftables,iproute2,ethtool,util-linux,mount,kmod,libseccomp2,pigz,bash,ca-certificates,curl,jq,procps,runc,containernetworking-plugins
base_tar="$cache/kind/base-bookworm-$(sha256sum <<<"$packages" | cut -c1-12).tar"
if [[ ! -f "$base_tar" ]]; then
  command -v debootstrap >/dev/null || apt_install debootstrap
  rootfs="$image_dir/rootfs"
  log "debootstrap bookworm for kind's node into $rootfs (a few minutes)"
  debootstrap --variant=minbase --include="$packages" bookworm "$rootfs" http://deb.debian.org/debian >&2
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" --numeric-owner -cf "$image_dir/base.tar" .
  mv "$image_dir/base.tar" "$base_tar"
  rm -rf "$rootfs"
fi
base_image="tether.local/kind-base:$(basename "$base_tar" .tar)"
docker image inspect "$base_image" >/dev/null 2>&1 || docker import "$base_tar" "$base_image" >&2

# kube-proxy on that base (iptables, conntrack, ipset-free iptables mode).
proxy_tree="$(mktemp -d "$image_dir/proxy.XXXXXX")"
install -D -m 0755 "$bin/kube-proxy" "$proxy_tree/usr/local/bin/kube-proxy"
printf 'FROM %s\nCOPY usr /usr\n' "$base_image" > "$proxy_tree/Dockerfile"
DOCKER_BUILDKIT=0 docker build -q --network host -t "$k8s/kube-proxy:${KUBERNETES_VERSION}" "$proxy_tree" >&2
docker save -o "$image_dir/images.tar" "$k8s/kube-apiserver:${KUBERNETES_VERSION}" \
  "$k8s/kube-controller-manager:${KUBERNETES_VERSION}" "$k8s/kube-scheduler:${KUBERNETES_VERSION}" \
  "$k8s/kube-proxy:${KUBERNETES_VERSION}" "$etcd_image" "$coredns_image" "$sandbox_image" "$provisioner_image" \
  "$helper_image"

# The node: kind's files and our binaries on the base, in a build container, then committed.
kind_files="$(go mod download -json "sigs.k8s.io/kind@${KIND_VERSION}" | sed -n 's/.*"Dir": "\(.*\)".*/\1/p')/images/base/files"
docker run -d --name "$build" --network none --security-opt seccomp=unconfined --entrypoint sleep "$base_image" infinity >&2
in_node() { docker exec -i "$build" bash -euo pipefail -c "$1" >&2; }
docker exec "$build" mkdir -p /etc/cni/net.d /usr/local/sbin
docker cp "$kind_files/." "$build:/" >&2
for b in containerd containerd-shim-runc-v2 ctr; do docker cp "$node_bin/$b" "$build:/usr/local/bin/$b"; done
docker cp "$bin/crictl" "$build:/usr/local/bin/crictl"
for b in kubeadm kubectl; do docker cp "$bin/$b" "$build:/usr/bin/$b"; done
docker cp "$node_bin/kubelet" "$build:/usr/bin/kubelet"
docker cp "$here/kind/runc-wrapper" "$build:/usr/local/sbin/runc-wrapper"
docker cp "$here/kind/10-bridge.conflist" "$build:/etc/cni/net.d/10-bridge.conflist"
docker cp "$image_dir/images.tar" "$build:/kind/images.tar"
docker exec "$build" mkdir -p /kind/manifests
sed 's/^\(  name: local-path\)$/\1\n  annotations: {storageclass.kubernetes.io\/is-default-class: "true"}/' "$storage_manifest" \
  > "$image_dir/default-storage.yaml"
grep -q 'is-default-class' "$image_dir/default-storage.yaml"
docker cp "$image_dir/default-storage.yaml" "$build:/kind/manifests/default-storage.yaml"
in_node "
  chmod 0755 /kind /kind/bin /kind/bin/* /usr/local/bin/* /usr/local/sbin/runc-wrapper /usr/bin/kubeadm /usr/bin/kubectl /usr/bin/kubelet
  chown -R root:root /kind /etc/systemd /etc/containerd /etc/default /etc/sysctl.d /etc/cni /usr/local
  # What kind's base image does after installing its packages: services a node container must not run.
  find /lib/systemd/system/sysinit.target.wants/ -name systemd-tmpfiles-setup.service -delete
  rm -f /lib/systemd/system/multi-user.target.wants/* /etc/systemd/system/*.wants/* \
    /lib/systemd/system/local-fs.target.wants/* /lib/systemd/system/sockets.target.wants/*udev* \
    /lib/systemd/system/sockets.target.wants/*initctl* /lib/systemd/system/basic.target.wants/*
  echo ReadKMsg=no >> /etc/systemd/journald.conf
  ln -sf /usr/lib/systemd/systemd /sbin/init
  systemctl enable kubelet.service containerd.service undo-mount-hacks.service
  systemctl mask systemd-binfmt.service
  mkdir -p /etc/kubernetes/manifests /opt/cni/bin
  cp /usr/lib/cni/* /opt/cni/bin/
  echo '${KUBERNETES_VERSION}' > /kind/version
  ctr oci spec | jq '.hooks.createContainer[.hooks.createContainer | length] |= . + {\"path\": \"/kind/bin/mount-product-files.sh\"}' \
    | jq 'del(.process.rlimits)' > /etc/containerd/cri-base.json
  # No CAP_SYS_RESOURCE here: runc through the wrapper, oom_score_adj restricted.
  sed -i -e 's/^\( *\)restrict_oom_score_adj = false/\1restrict_oom_score_adj = true/' \
    -e 's|^\( *\)SystemdCgroup = true|\1SystemdCgroup = true\n\1BinaryName = \"/usr/local/sbin/runc-wrapper\"|' \
    /etc/containerd/config.toml
  grep -q 'restrict_oom_score_adj = true' /etc/containerd/config.toml
  grep -q 'BinaryName = \"/usr/local/sbin/runc-wrapper\"' /etc/containerd/config.toml
  # The images kubeadm runs, as kind preloads them: content only, pinned, unpacked on first use.
  containerd >/tmp/containerd.log 2>&1 &
  for _ in \$(seq 1 60); do ctr version >/dev/null 2>&1 && break; sleep 1; done
  ctr --namespace=k8s.io images import --label=io.cri-containerd.pinned=pinned --all-platforms --no-unpack \
    --digests /kind/images.tar
  ctr --namespace=k8s.io images list -q
  pkill containerd
  for _ in \$(seq 1 30); do pgrep -x containerd >/dev/null || break; sleep 1; done
  rm -f /kind/images.tar /tmp/containerd.log
"
docker commit --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' --change 'ENV container=docker' \
  "$build" "$NODE_IMAGE-committed" >&2
# (`docker commit` cannot set a stop signal; systemd stops cleanly on this one.)
printf 'FROM %s\nSTOPSIGNAL SIGRTMIN+3\n' "$NODE_IMAGE-committed" | DOCKER_BUILDKIT=0 docker build -q -t "$NODE_IMAGE" - >&2
docker rmi "$NODE_IMAGE-committed" >/dev/null
docker save -o "$out/node-image.tar.tmp" "$NODE_IMAGE"
mv "$out/node-image.tar.tmp" "$out/node-image.tar"
cat > "$out/node-image.env" <<EOF
NODE_IMAGE=$NODE_IMAGE
ETCD_IMAGE_TAG=${ETCD_VERSION#v}-0
EOF
touch "$out/.complete"
# Each recipe change makes a new node image (about 1 GB): keep only this one.
for old in "$cache"/kind/v*_kind-*; do
  [[ "$old" != "$out" ]] && rm -rf "$old"
done
docker images --format '{{.Repository}}:{{.Tag}}' tether.local/kind-node | grep -vxF "$NODE_IMAGE" \
  | xargs -r docker rmi >/dev/null 2>&1 || true  # (one still in use by a cluster stays)
for old in "$cache"/kind/bin-*; do
  [[ "$old" != "$bin" ]] && rm -rf "$old"
done
echo "$out"
