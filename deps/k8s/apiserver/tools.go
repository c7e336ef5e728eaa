//go:build tools

// Package build pins the Kubernetes module whose kube-apiserver the cluster tests start
// (scripts/build-k8s.sh). k8s.io/kubernetes is not meant to be a dependency: its go.mod
// replaces its staging modules with directories of its own repository, which a module
// that requires it does not see, so go.mod here replaces each with its published v0.x.
package build

import _ "k8s.io/kubernetes/cmd/kube-apiserver"
