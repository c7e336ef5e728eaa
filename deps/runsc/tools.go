//go:build tools

// Package build pins the gVisor module whose runsc cpuos runs (scripts/build-runsc.sh).
package build

import _ "gvisor.dev/gvisor/runsc"
