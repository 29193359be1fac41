// promql-names reads a JSON list of PromQL expressions on stdin and prints, as JSON, for each one
// the metric names its selectors read, parsed by Prometheus's own parser (promql/parser), so a
// test can check them against what the operator exports. An expression that does not parse is
// reported with its error instead.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
)

type result struct {
	Expr  string   `json:"expr"`
	Names []string `json:"names"`
	Error string   `json:"error,omitempty"`
}

func names(expr string) ([]string, error) {
	node, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var problem error
	parser.Inspect(node, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		if name == "" {
			for _, m := range vs.LabelMatchers {
				if m.Name == labels.MetricName && m.Type == labels.MatchEqual {
					name = m.Value
				}
			}
		}
		if name == "" {
			problem = fmt.Errorf("a selector without a metric name: %s", vs.String())
			return nil
		}
		seen[name] = true
		return nil
	})
	if problem != nil {
		return nil, problem
	}
	out := make([]string, 0, len(seen))
	for name := range seen {
		out = append(out, name)
	}
	sort.Strings(out)
	return out, nil
}

func main() {
	var exprs []string
	if err := json.NewDecoder(os.Stdin).Decode(&exprs); err != nil {
		fmt.Fprintln(os.Stderr, "promql-names: stdin must be a JSON list of strings:", err)
		os.Exit(2)
	}
	results := make([]result, 0, len(exprs))
	for _, expr := range exprs {
		r := result{Expr: expr, Names: []string{}}
		if found, err := names(expr); err != nil {
			r.Error = err.Error()
		} else {
			r.Names = found
		}
		results = append(results, r)
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	if err := enc.Encode(results); err != nil {
		os.Exit(1)
	}
}
