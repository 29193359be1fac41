"""The local development control plane (real kube-apiserver, etcd, controllers) and the process kubelet."""
