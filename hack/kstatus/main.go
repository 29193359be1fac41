// kstatus-check prints the kstatus result (sigs.k8s.io/cli-utils) for each
// object given as a JSON file argument: {"status": "...", "message": "..."}.
// Tests use it to check that WorkerRun conditions mean what Flux and Argo CD
// expect.
package main

import (
	"encoding/json"
	"fmt"
	"os"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/cli-utils/pkg/kstatus/status"
)

func main() {
	out := []map[string]string{}
	for _, path := range os.Args[1:] {
		data, err := os.ReadFile(path)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		// UnmarshalJSON keeps integers as int64, as the API machinery expects.
		obj := &unstructured.Unstructured{}
		if err := obj.UnmarshalJSON(data); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		res, err := status.Compute(obj)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		out = append(out, map[string]string{"status": res.Status.String(), "message": res.Message})
	}
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(out); err != nil {
		os.Exit(2)
	}
}
