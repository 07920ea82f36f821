// kstatus-check: reads Kubernetes objects (a JSON array) on stdin and prints, for each, the
// status sigs.k8s.io/cli-utils' kstatus computes for it (what Flux's and kpt's health checks
// use), as a JSON array of {"status", "message"}. kvpilot's tests feed it LLMDeployments
// written by the operator's own status code (tests/chart/test_kstatus.py).
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	utiljson "k8s.io/apimachinery/pkg/util/json"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

type result struct {
	Status  string `json:"status"`
	Message string `json:"message"`
}

func main() {
	// apimachinery's decoder keeps integers int64, as the API server's objects have them.
	var objects []map[string]interface{}
	raw, err := io.ReadAll(os.Stdin)
	if err == nil {
		err = utiljson.Unmarshal(raw, &objects)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "reading objects:", err)
		os.Exit(2)
	}
	out := make([]result, 0, len(objects))
	for _, obj := range objects {
		r, err := status.Compute(&unstructured.Unstructured{Object: obj})
		if err != nil {
			fmt.Fprintln(os.Stderr, "kstatus:", err)
			os.Exit(1)
		}
		out = append(out, result{Status: r.Status.String(), Message: r.Message})
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		os.Exit(1)
	}
}
