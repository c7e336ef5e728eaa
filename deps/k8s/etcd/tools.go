//go:build tools

// Package build pins the etcd module whose server the cluster tests start beside
// kube-apiserver (scripts/build-k8s.sh).
package build

import _ "go.etcd.io/etcd/server/v3"
