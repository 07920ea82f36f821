//go:build tools

// Pins the commands build.sh compiles, so go mod tidy keeps their dependencies.
package tools

import (
	_ "github.com/prometheus-operator/prometheus-operator/cmd/operator"
	_ "github.com/prometheus-operator/prometheus-operator/cmd/prometheus-config-reloader"
)
