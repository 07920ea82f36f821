// Command etcd is etcd's own server entry point (go.etcd.io/etcd/server/v3/etcdmain),
// built from the version that the pinned Kubernetes release is tested with.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
