package tether

// The ownership protocol's vocabulary as pure functions, no I/O: when a Lease is ours, the
// renewal we write, the usage annotation and which reports are acceptable, the control signals
// and the cap arithmetic, the fenced result patch and how to recognise a publication that landed.
// They mirror operator/tether/protocol.py, which the operator and the gateway use.

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Lease annotations: the worker's reports and approval requests, and the operator's signals.
const (
	annCheckpoint = "tether.dev/checkpoint"
	annUsage      = "tether.dev/usage"
	annRequests   = "tether.dev/requests"
	annSignals    = "tether.dev/signals"
)

// Reports beyond these are malformed, not spending (the CRD's own bounds).
const (
	maxCents  int64 = 100_000_000_000
	maxTokens int64 = 100_000_000_000_000
)

// maxCursorChars bounds a checkpoint cursor (the gateway and the operator refuse longer ones).
const maxCursorChars = 1024

// The attempt outcome that only a published result or error produces.
var publishedOutcome = map[string]string{"result": "Succeeded", "error": "WorkerFailed"}

// margin is how long before the lease deadline ownership stops counting as confirmed.
func margin(leaseDuration time.Duration) time.Duration {
	return max(time.Second, leaseDuration/10)
}

// requestTimeout is how long a request may go unanswered before it counts as "no answer".
func requestTimeout(renewInterval time.Duration) time.Duration {
	return min(10*time.Second, max(renewInterval, time.Second))
}

// publicationTimeout bounds a publication (and the read that checks whether a lost one landed)
// instead of the request timeout (docs/protocol.md §3): its body may be megabytes that the API
// server decodes and validates before answering, and the heartbeat goes on meanwhile, while the
// request timeout would count a slow answer as none and send the same megabytes again and again.
const publicationTimeout = 30 * time.Second

// usage is an attempt's cumulative spending, as reported on the Lease.
type usage struct {
	Cents  int64 `json:"cents"`
	Tokens int64 `json:"tokens"`
}

// usageAnnotation is the tether.dev/usage value: compact JSON.
func usageAnnotation(u usage) string {
	return fmt.Sprintf(`{"cents":%d,"tokens":%d}`, u.Cents, u.Tokens)
}

// validReport says why a cumulative usage report is refused, or "" when it is acceptable.
func validReport(report usage, previous *usage) string {
	switch {
	case report.Cents < 0 || report.Tokens < 0:
		return "negative usage"
	case report.Cents > maxCents || report.Tokens > maxTokens:
		return "implausibly large usage"
	case previous != nil && (report.Cents < previous.Cents || report.Tokens < previous.Tokens):
		return "usage decreased; reports are cumulative"
	}
	return ""
}

// validCursor says why a checkpoint cursor is refused, or "" when it is acceptable.
func validCursor(cursor string) string {
	if n := utf8.RuneCountInString(cursor); n > maxCursorChars {
		return fmt.Sprintf("checkpoint cursor of %d characters exceeds %d", n, maxCursorChars)
	}
	return ""
}

// leaseView is what the protocol reads of a Lease (docs/protocol.md §5.1), with the types it reads
// them as: a body whose fields have other types is not a Lease. Pointers tell absent and null (alike,
// as in the Python and TypeScript SDKs) from a value.
type leaseView struct {
	Kind       *string `json:"kind"`
	APIVersion *string `json:"apiVersion"`
	Metadata   *struct {
		ResourceVersion *string            `json:"resourceVersion"`
		Annotations     map[string]*string `json:"annotations"`
		OwnerReferences []*ownerReference  `json:"ownerReferences"`
	} `json:"metadata"`
	Spec *struct {
		HolderIdentity   *string `json:"holderIdentity"`
		LeaseTransitions *int64  `json:"leaseTransitions"`
	} `json:"spec"`
}

type ownerReference struct {
	Kind       string `json:"kind"`
	UID        string `json:"uid"`
	Controller *bool  `json:"controller"`
}

// isLease says whether the view is a Lease's: this kind and version (when named), a resourceVersion
// (without one a renewal's PUT is not a compare-and-swap), no null annotation or owner reference.
func (v *leaseView) isLease() bool {
	if v == nil || (v.Kind != nil && *v.Kind != "Lease") ||
		(v.APIVersion != nil && *v.APIVersion != "coordination.k8s.io/v1") ||
		v.Metadata == nil || v.Metadata.ResourceVersion == nil || *v.Metadata.ResourceVersion == "" {
		return false
	}
	for _, value := range v.Metadata.Annotations {
		if value == nil {
			return false
		}
	}
	for _, ref := range v.Metadata.OwnerReferences {
		if ref == nil {
			return false
		}
	}
	return true
}

func (v *leaseView) annotation(key string) string {
	if value := v.Metadata.Annotations[key]; value != nil {
		return *value
	}
	return ""
}

// controllerUID is the UID of the WorkerRun that controls the Lease, if any.
func (v *leaseView) controllerUID() (string, bool) {
	for _, ref := range v.Metadata.OwnerReferences {
		if ref.Kind == "WorkerRun" && ref.Controller != nil && *ref.Controller {
			return ref.UID, true
		}
	}
	return "", false
}

// holds says whether the Lease names exactly this holder and fence and, when runUID is given,
// belongs to that run: a run deleted and re-created under its name starts again at holder
// <name>-a1 and fence 1, and only the UID tells the two apart. Nobody holds a cleared Lease.
func holds(lease *leaseView, holder string, fence int64, runUID string) bool {
	if lease == nil || holder == "" || lease.Spec == nil {
		return false
	}
	spec := lease.Spec
	if spec.HolderIdentity == nil || *spec.HolderIdentity != holder ||
		spec.LeaseTransitions == nil || *spec.LeaseTransitions != fence {
		return false
	}
	if runUID == "" {
		return true
	}
	uid, ok := lease.controllerUID()
	return ok && uid == runUID
}

// leaseDoc is a Lease as the API server sent it: its exact JSON, which a renewal sends back (a
// typed client keeps only the fields it knows, and a renewal that drops a newer API server's field
// erases it or is refused by the admission policy, read as lost), and the fields the protocol reads.
type leaseDoc struct {
	raw  json.RawMessage
	view leaseView
}

// parseLease reads an answer's body as a Lease. An error says it is not one: not JSON (a proxy's
// HTML page), JSON of another shape (a Status, null, a proxy's error), or a Lease whose fields the
// protocol reads have other types. Such an answer says nothing about ownership (docs/protocol.md
// §5.2): unconfirmed. The Python and TypeScript SDKs draw the same line (sdk/vectors/leases.json).
func parseLease(raw []byte) (*leaseDoc, error) {
	var view *leaseView
	if err := json.Unmarshal(raw, &view); err != nil {
		return nil, fmt.Errorf("not a Lease: %w", err)
	}
	if !view.isLease() {
		return nil, fmt.Errorf("not a Lease: %s", clip(string(raw)))
	}
	return &leaseDoc{raw: raw, view: *view}, nil
}

// renewal is the body of a heartbeat: the Lease exactly as last seen (its resourceVersion makes the
// PUT a compare-and-swap), renewTime set, checkpoint and usage (and extra annotations: the approval
// requests) riding on the same write.
func renewal(lease json.RawMessage, now time.Time, checkpoint *string, u *usage, extra map[string]string) (json.RawMessage, error) {
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(lease, &obj); err != nil {
		return nil, err
	}
	spec, err := jsonObject(obj["spec"])
	if err != nil {
		return nil, fmt.Errorf("spec: %w", err)
	}
	meta, err := jsonObject(obj["metadata"])
	if err != nil {
		return nil, fmt.Errorf("metadata: %w", err)
	}
	ann := map[string]string{}
	if raw, ok := meta["annotations"]; ok {
		if err := json.Unmarshal(raw, &ann); err != nil {
			return nil, fmt.Errorf("annotations: %w", err)
		}
		if ann == nil { // "annotations": null
			ann = map[string]string{}
		}
	}
	if checkpoint != nil {
		ann[annCheckpoint] = *checkpoint
	}
	if u != nil {
		ann[annUsage] = usageAnnotation(*u)
	}
	maps.Copy(ann, extra)
	if spec["renewTime"], err = json.Marshal(metav1.NewMicroTime(now.UTC())); err != nil {
		return nil, err
	}
	if meta["annotations"], err = json.Marshal(ann); err != nil {
		return nil, err
	}
	if obj["spec"], err = json.Marshal(spec); err != nil {
		return nil, err
	}
	if obj["metadata"], err = json.Marshal(meta); err != nil {
		return nil, err
	}
	return json.Marshal(obj)
}

// jsonObject splits a JSON object into its members, each kept exactly as it was; absent or null is empty.
func jsonObject(raw json.RawMessage) (map[string]json.RawMessage, error) {
	members := map[string]json.RawMessage{}
	if len(raw) == 0 {
		return members, nil
	}
	if err := json.Unmarshal(raw, &members); err != nil {
		return nil, err
	}
	if members == nil { // null
		members = map[string]json.RawMessage{}
	}
	return members, nil
}

// signalState is what the control plane says, as carried on the Lease (tether.dev/signals).
type signalState struct {
	Stop bool
	// With Stop: Kueue evicted the run (checkpoint and exit; it resumes from there), and StopBy is
	// when the attempt is revoked whatever the worker does.
	Yield      bool
	StopBy     *time.Time
	Paused     bool
	Reason     string
	EndsAt     *time.Time
	CapCents   *int64
	CapTokens  *int64
	BaseCents  int64 // spent by earlier attempts: the worker's own reports count from zero
	BaseTokens int64
	// Decisions on this attempt's approval requests, by request name (only this attempt's: the
	// operator rewrites the Lease at every grant).
	Decisions map[string]ApprovalDecision
}

// parseSignals reads a tether.dev/signals value. An empty value means no signal (defaults);
// ok is false when it is malformed, and the caller keeps the signals it had.
func parseSignals(raw string) (s signalState, ok bool) {
	if raw == "" {
		return signalState{}, true
	}
	var fields map[string]json.RawMessage
	if !strings.HasPrefix(strings.TrimSpace(raw), "{") || json.Unmarshal([]byte(raw), &fields) != nil {
		return signalState{}, false
	}
	for key, val := range fields {
		isNull := bytes.Equal(bytes.TrimSpace(val), []byte("null"))
		var err error
		switch key {
		case "stop":
			err = decodeStrict(val, isNull, &s.Stop)
		case "paused":
			err = decodeStrict(val, isNull, &s.Paused)
		case "yield":
			err = decodeStrict(val, isNull, &s.Yield)
		case "stopBy":
			if !isNull {
				var text string
				if err = json.Unmarshal(val, &text); err == nil {
					s.StopBy, err = parseTime(text)
				}
			}
		case "baseCents":
			s.BaseCents, err = jsonInt(val, isNull)
		case "baseTokens":
			s.BaseTokens, err = jsonInt(val, isNull)
		case "reason":
			if !isNull {
				err = json.Unmarshal(val, &s.Reason)
			}
		case "endsAt":
			if !isNull {
				var text string
				if err = json.Unmarshal(val, &text); err == nil {
					s.EndsAt, err = parseTime(text)
				}
			}
		case "capCents":
			s.CapCents, err = jsonOptionalInt(val, isNull)
		case "capTokens":
			s.CapTokens, err = jsonOptionalInt(val, isNull)
		case "decisions":
			// null or any malformed entry makes the whole annotation malformed, as a wrong type
			// in any other signal does (§7).
			s.Decisions, err = parseDecisions(val)
		}
		if err != nil {
			return signalState{}, false
		}
	}
	return s, true
}

// decodeStrict decodes a value that may not be null (the operator never writes null there).
func decodeStrict(val json.RawMessage, isNull bool, into any) error {
	if isNull {
		return fmt.Errorf("null where a value is required")
	}
	return json.Unmarshal(val, into)
}

// jsonInt reads a JSON integer; a float without a fractional part counts, as it does for the operator.
func jsonInt(val json.RawMessage, isNull bool) (int64, error) {
	if isNull {
		return 0, fmt.Errorf("null where an integer is required")
	}
	// json.Number also takes a string holding a number ("50"): a string is malformed here.
	if trimmed := bytes.TrimSpace(val); len(trimmed) == 0 || trimmed[0] == '"' {
		return 0, fmt.Errorf("%s is not a JSON number", val)
	}
	var num json.Number
	if err := json.Unmarshal(val, &num); err != nil {
		return 0, err
	}
	if n, err := num.Int64(); err == nil {
		return n, nil
	}
	f, err := num.Float64()
	if err != nil || f != float64(int64(f)) {
		return 0, fmt.Errorf("%s is not an integer", num)
	}
	return int64(f), nil
}

func jsonOptionalInt(val json.RawMessage, isNull bool) (*int64, error) {
	if isNull {
		return nil, nil
	}
	n, err := jsonInt(val, false)
	if err != nil {
		return nil, err
	}
	return &n, nil
}

// parseTime reads a Kubernetes or gateway time stamp (RFC 3339).
func parseTime(text string) (*time.Time, error) {
	t, err := time.Parse(time.RFC3339Nano, text)
	if err != nil {
		return nil, err
	}
	return &t, nil
}

// leaseSignals reads the operator's signals from a Lease; ok is false when they are malformed.
func leaseSignals(lease *leaseView) (signalState, bool) {
	return parseSignals(lease.annotation(annSignals))
}

// remaining is what is left of the run's caps, counting the attempt's own usage: cap - base - own
// (nil: no cap).
func (s signalState) remaining(own *usage) (cents, tokens *int64) {
	var u usage
	if own != nil {
		u = *own
	}
	left := func(limit *int64, base, spent int64) *int64 {
		if limit == nil {
			return nil
		}
		v := *limit - base - spent
		return &v
	}
	return left(s.CapCents, s.BaseCents, u.Cents), left(s.CapTokens, s.BaseTokens, u.Tokens)
}

// capUsedUp says why the attempt may not spend any more of the run's own caps, or "": what the
// control plane last said was left of a cap, less what the attempt reported since (Signals'
// CapRemainingCents / CapRemainingTokens; nil: no cap), is used up -- nothing left, or less. The
// meter refuses requests on it, and the run renews at once when a report makes it true.
func capUsedUp(centsLeft, tokensLeft *int64) string {
	if centsLeft != nil && *centsLeft <= 0 {
		return fmt.Sprintf("the run's cap is used up (%d cents left)", *centsLeft)
	}
	if tokensLeft != nil && *tokensLeft <= 0 {
		return fmt.Sprintf("the run's token cap is used up (%d tokens left)", *tokensLeft)
	}
	return ""
}

// signalsFromRemaining is the inverse of remaining: signals equivalent to a gateway reply that
// states what was left when `own` was reported, so usage reported later counts as it does for a
// pod worker.
func signalsFromRemaining(stop, paused bool, endsAt *time.Time, centsLeft, tokensLeft *int64, own *usage) signalState {
	var u usage
	if own != nil {
		u = *own
	}
	capOf := func(left *int64, spent int64) *int64 {
		if left == nil {
			return nil
		}
		v := *left + spent
		return &v
	}
	return signalState{Stop: stop, Paused: paused, EndsAt: endsAt,
		CapCents: capOf(centsLeft, u.Cents), CapTokens: capOf(tokensLeft, u.Tokens)}
}

// --- approval requests (docs/protocol.md §9) ---------------------------------------

// requestName is a request's name: what a WorkerRunApproval's spec.gate names to decide it.
var requestName = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$`)

// reservedRequestNames name the run's own gates (Start, Result), which a worker cannot ask for.
var reservedRequestNames = []string{"start", "result"}

const (
	maxRequestsPerAttempt = 20
	maxRequestDetails     = 4096
	maxRequestTimeout     = 31_536_000
	// maxRequestsBytes bounds the annotation as a whole: the Lease's annotations share 256 KiB with
	// the operator's signals, and the admission policy refuses a worker's larger one.
	maxRequestsBytes = 65_536
)

// approvalRequest is one approval a worker asks for: its name, what it wants to do, and how long
// it waits (nil: no timeout).
type approvalRequest struct {
	Name           string
	Details        string
	TimeoutSeconds *int
}

// requestRefusal says why an approval request is malformed (what the operator and the gateway
// would refuse), or "" when it is acceptable.
func requestRefusal(name, details string, timeoutSeconds *int) string {
	switch {
	case !requestName.MatchString(name):
		return "a request's name is lower-case letters, digits and '-', 1 to 63 characters"
	case slices.Contains(reservedRequestNames, name):
		return fmt.Sprintf("'%s' names a gate of the run itself (Start, Result), not a request", name)
	case utf8.RuneCountInString(details) > maxRequestDetails: // characters as the operator counts them
		return fmt.Sprintf("details must be a string of at most %d characters", maxRequestDetails)
	case timeoutSeconds != nil && (*timeoutSeconds < 1 || *timeoutSeconds > maxRequestTimeout):
		return fmt.Sprintf("timeoutSeconds must be an integer from 1 to %d", maxRequestTimeout)
	}
	return ""
}

// requestsAnnotation is the tether.dev/requests value: every request of the attempt, by name. Byte
// for byte what the Python SDK writes (sorted keys, compact, UTF-8, timeoutSeconds only when set),
// so every SDK sends the same annotation for the same requests.
func requestsAnnotation(requests []approvalRequest) string {
	sorted := slices.SortedFunc(slices.Values(requests), func(a, b approvalRequest) int {
		return strings.Compare(a.Name, b.Name)
	})
	var b strings.Builder
	b.WriteByte('{')
	for i, r := range sorted {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(pythonJSON(r.Name) + `:{"details":` + pythonJSON(r.Details))
		if r.TimeoutSeconds != nil {
			fmt.Fprintf(&b, `,"timeoutSeconds":%d`, *r.TimeoutSeconds)
		}
		b.WriteByte('}')
	}
	b.WriteByte('}')
	return b.String()
}

// pythonJSON is a JSON string as Python's json.dumps writes it with ensure_ascii=False: the short
// escapes for quote, backslash and \b \f \n \r \t, \u00XX for the other control characters, and
// everything else as it is. encoding/json differs: it escapes <, >, &, U+2028 and U+2029.
func pythonJSON(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		default:
			if r < 0x20 {
				fmt.Fprintf(&b, `\u%04x`, r)
			} else {
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
	return b.String()
}

// decisionValues are the decisions a person (or the deadline) makes on a request.
var decisionValues = []string{"Approve", "Deny", "TimedOut"}

// parseDecisions reads the decisions signal: {"<name>": {"decision", "reason"?, "approver"?}}. An
// error when it is not that, in any entry: a decision is acted upon, so none is taken from a
// value that is wrong anywhere. Unknown keys of an entry are ignored, as the operator's model does.
func parseDecisions(raw json.RawMessage) (map[string]ApprovalDecision, error) {
	var entries map[string]json.RawMessage
	if err := json.Unmarshal(raw, &entries); err != nil || entries == nil {
		return nil, fmt.Errorf("decisions: not a JSON object")
	}
	out := make(map[string]ApprovalDecision, len(entries))
	for name, entry := range entries {
		var fields map[string]json.RawMessage
		if err := json.Unmarshal(entry, &fields); err != nil || fields == nil {
			return nil, fmt.Errorf("decision %q: not a JSON object", name)
		}
		var d ApprovalDecision
		if err := json.Unmarshal(fields["decision"], &d.Decision); err != nil || !slices.Contains(decisionValues, d.Decision) {
			return nil, fmt.Errorf("decision %q: not one of %v", name, decisionValues)
		}
		var err error
		if d.Reason, err = optionalString(fields["reason"]); err != nil {
			return nil, fmt.Errorf("decision %q: reason: %w", name, err)
		}
		if d.Approver, err = optionalString(fields["approver"]); err != nil {
			return nil, fmt.Errorf("decision %q: approver: %w", name, err)
		}
		out[name] = d
	}
	return out, nil
}

// optionalString reads a JSON string that may be absent or null ("" then).
func optionalString(raw json.RawMessage) (string, error) {
	var v *string
	if len(raw) == 0 {
		return "", nil
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return "", err
	}
	if v == nil {
		return "", nil
	}
	return *v, nil
}

// patchOp is one operation of a JSON patch (RFC 6902).
type patchOp struct {
	Op    string `json:"op"`
	Path  string `json:"path"`
	Value any    `json:"value"`
}

// fencedPatch publishes a result or an error only while fence and holder are still the run's
// (and, given runUID, only to that run, never to a namesake created since): the API server
// applies the add only if every test holds, else it answers 422.
func fencedPatch(holder string, fence int64, field string, value json.RawMessage, runUID string) []patchOp {
	ops := make([]patchOp, 0, 4)
	if runUID != "" {
		ops = append(ops, patchOp{Op: "test", Path: "/metadata/uid", Value: runUID})
	}
	return append(ops,
		patchOp{Op: "test", Path: "/status/fence", Value: fence},
		patchOp{Op: "test", Path: "/status/holder", Value: holder},
		patchOp{Op: "add", Path: "/status/" + field, Value: value})
}

// refusesValue says whether a 422's causes name the published value itself (status.<field>, or a
// part of it: status.<field>.x, status.<field>[0]): only then is it a bad value. Causes about other
// fields say nothing this publication can fix, so that 422 is the failed ownership test.
func refusesValue(causes []InvalidCause, field string) bool {
	name := "status." + field
	for _, c := range causes {
		if c.Field == name || strings.HasPrefix(c.Field, name+".") || strings.HasPrefix(c.Field, name+"[") {
			return true
		}
	}
	return false
}

// runView is the part of a WorkerRun that tells whether a publication landed.
type runView struct {
	Metadata struct {
		UID string `json:"uid"`
	} `json:"metadata"`
	Status struct {
		Holder   *string         `json:"holder"`
		Fence    *int64          `json:"fence"`
		Result   json.RawMessage `json:"result"`
		Error    json.RawMessage `json:"error"`
		Attempts []struct {
			Holder  string `json:"holder"`
			Fence   *int64 `json:"fence"`
			Outcome string `json:"outcome"`
		} `json:"attempts"`
	} `json:"status"`
}

// publicationRecorded says whether the run shows that this attempt's field was accepted: after a
// request whose answer was lost the retry is refused (a success moves the fence too), yet the
// first one landed.
func publicationRecorded(run runView, holder string, fence int64, field string, value json.RawMessage) bool {
	st := run.Status
	recorded := st.Result
	if field == "error" {
		recorded = st.Error
	}
	if st.Holder != nil && *st.Holder == holder && st.Fence != nil && *st.Fence == fence {
		return jsonEqual(recorded, value)
	}
	last := -1
	for i, a := range st.Attempts {
		if a.Holder == holder && a.Fence != nil && *a.Fence == fence {
			last = i
		}
	}
	if last < 0 || st.Attempts[last].Outcome != publishedOutcome[field] {
		return false
	}
	return field != "result" || jsonEqual(st.Result, value)
}

// jsonEqual compares two JSON documents by value (an absent document is null).
func jsonEqual(a, b json.RawMessage) bool {
	var x, y any
	if len(a) > 0 && json.Unmarshal(a, &x) != nil {
		return false
	}
	if len(b) > 0 && json.Unmarshal(b, &y) != nil {
		return false
	}
	return reflect.DeepEqual(x, y)
}

// maxRetryAfter bounds a Retry-After: longer than any lease (at most a day), so a publication still
// gives up at once, and short enough not to overflow a Duration.
const maxRetryAfter = 7 * 24 * time.Hour

// retryAfterHeader reads a Retry-After header: seconds (decimals allowed, docs/protocol.md §3), or
// an HTTP date.
func retryAfterHeader(value string, now time.Time) time.Duration {
	value = strings.TrimSpace(value)
	if value == "" {
		return 0
	}
	if secs, err := strconv.ParseFloat(value, 64); err == nil {
		if !(secs > 0) { // negative, or NaN
			return 0
		}
		return time.Duration(min(secs, maxRetryAfter.Seconds()) * float64(time.Second))
	}
	if at, err := http.ParseTime(value); err == nil {
		return min(max(at.Sub(now), 0), maxRetryAfter)
	}
	return 0
}

// --- child runs (docs/children.md) ------------------------------------------------

// On each child: its parent's name (a label, to list a parent's children), the caller's key and the
// digest of what the key was asked to run (tether.children.api).
const (
	labelParent    = "tether.dev/parent"
	annChildKey    = "tether.dev/child-key"
	annSpawnDigest = "tether.dev/spawn-digest"
)

const (
	// A child's name is its parent's cut to childNamePrefix characters, a dash, and childNameDigest
	// hex digits (run names have at most 58 characters).
	childNamePrefix = 47
	childNameDigest = 10
	// maxGenerations bounds how often a key moves on past a child rejected as a stale attempt's
	// (each one a lost parent attempt).
	maxGenerations = 16
	// staleParent is the reason of a child rejected because the attempt that spawned it no longer
	// held the parent: it never ran.
	staleParent = "StaleParent"
)

// childKey is a caller's key: what an idempotency key may be, a stable name of one tool call.
var childKey = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9._:/-]{0,126}[A-Za-z0-9])?$`)

// terminalPhases are the phases a run ends in.
var terminalPhases = []string{"Succeeded", "Failed", "Lost", "Cancelled", "BudgetExceeded", "DeadlineExceeded", "Rejected"}

// childName is the child's name for key under this parent: by its UID, so a namesake parent gets
// other names; generation counts the children of that key rejected as a stale attempt's.
func childName(parentName, parentUID, key string, generation int) string {
	named := key
	if generation != 0 {
		named = fmt.Sprintf("%s#%d", key, generation)
	}
	sum := sha256.Sum256([]byte(parentUID + "/" + named))
	prefix := strings.TrimRight(parentName[:min(len(parentName), childNamePrefix)], "-.")
	return prefix + "-" + hex.EncodeToString(sum[:])[:childNameDigest]
}

// spawnDigest is what a spawn asked for (the child's spec as the caller gave it), as the digest
// every SDK and the gateway compute: sha256 of the spec as Python's json.dumps writes it with sorted
// keys, compact, non-ASCII as UTF-8 (sdk/vectors/children.json). Two spawns of one key are one child
// only when they asked for the same. The spec holds plain JSON values (childSpec's).
func spawnDigest(spec map[string]any) string {
	var b strings.Builder
	writeCanonical(&b, spec)
	sum := sha256.Sum256([]byte(b.String()))
	return hex.EncodeToString(sum[:])
}

// writeCanonical writes a plain JSON value (plainJSON's) as Python's json.dumps does with
// sort_keys, compact separators and ensure_ascii=False. Not encoding/json's own: it escapes U+2028
// and U+2029 (pythonJSON) and writes floats otherwise (pythonNumber), so such a spec would digest
// otherwise than the gateway's.
func writeCanonical(b *strings.Builder, v any) {
	switch v := v.(type) {
	case map[string]any:
		b.WriteByte('{')
		for i, k := range slices.Sorted(maps.Keys(v)) { // UTF-8 byte order is code point order, as Python sorts
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(pythonJSON(k) + ":")
			writeCanonical(b, v[k])
		}
		b.WriteByte('}')
	case []any:
		b.WriteByte('[')
		for i, item := range v {
			if i > 0 {
				b.WriteByte(',')
			}
			writeCanonical(b, item)
		}
		b.WriteByte(']')
	case string:
		b.WriteString(pythonJSON(v))
	case json.Number:
		b.WriteString(pythonNumber(v))
	case bool:
		b.WriteString(strconv.FormatBool(v))
	default: // nil: plainJSON makes no other type
		b.WriteString("null")
	}
}

// pythonNumber is a JSON number as Python's json.dumps writes it once json.loads has read it (the
// gateway digests the spec it parsed from this SDK's JSON): an integer as written, any other number
// as a float's repr (shortest round trip, exponent below 1e-4 and from 1e16, ".0" when integral).
func pythonNumber(n json.Number) string {
	if !strings.ContainsAny(string(n), ".eE") {
		return string(n)
	}
	f, err := n.Float64()
	if err != nil { // out of a float's range: Python's repr is inf, which is no JSON either
		return string(n)
	}
	mantissa, exp, _ := strings.Cut(strconv.FormatFloat(f, 'e', -1, 64), "e")
	if e, _ := strconv.Atoi(exp); e < -4 || e >= 16 {
		return mantissa + "e" + exp // Go writes the exponent as Python does: a sign, at least two digits
	}
	fixed := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.Contains(fixed, ".") {
		fixed += ".0"
	}
	return fixed
}

// plainJSON is v as JSON values (objects, arrays, strings, json.Number, booleans, nil) whatever Go
// types the caller used (a pod template's struct, int64): what is digested is what is sent, numbers
// exactly as written.
func plainJSON(v any) (map[string]any, error) {
	raw, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("tether: the child's spec is not JSON: %w", err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var out map[string]any
	if err := dec.Decode(&out); err != nil {
		return nil, fmt.Errorf("tether: the child's spec is not a JSON object: %w", err)
	}
	return out, nil
}

// parentRun is what a child's spec says of the run that spawns it.
type parentRun struct {
	name, uid    string
	className    string // the class the run took ("": none)
	depth        int64  // the run's own depth as a child (0: not one)
	budgetRef    string // the WorkerBudget its budget draws on ("": none)
	cappedCents  bool
	cappedTokens bool
}

// parentOf reads a run as its children name it, with what it took from its class:
// status.class.defaults.budget fills, field by field, what spec.budget leaves out.
func parentOf(raw []byte) (parentRun, error) {
	var run struct {
		Metadata struct {
			Name string `json:"name"`
			UID  string `json:"uid"`
		} `json:"metadata"`
		Spec struct {
			Budget    map[string]json.RawMessage `json:"budget"`
			ParentRef struct {
				Depth int64 `json:"depth"`
			} `json:"parentRef"`
		} `json:"spec"`
		Status struct {
			Class struct {
				Name     string `json:"name"`
				Defaults struct {
					Budget map[string]json.RawMessage `json:"budget"`
				} `json:"defaults"`
			} `json:"class"`
		} `json:"status"`
	}
	if err := json.Unmarshal(raw, &run); err != nil {
		return parentRun{}, fmt.Errorf("tether: the run as read: %w", err)
	}
	budget := maps.Clone(run.Status.Class.Defaults.Budget)
	if budget == nil {
		budget = map[string]json.RawMessage{}
	}
	maps.Copy(budget, run.Spec.Budget)
	var ref struct {
		Name string `json:"name"`
	}
	if notNull(budget["budgetRef"]) {
		if err := json.Unmarshal(budget["budgetRef"], &ref); err != nil {
			return parentRun{}, fmt.Errorf("tether: the run's budget.budgetRef: %w", err)
		}
	}
	return parentRun{name: run.Metadata.Name, uid: run.Metadata.UID, className: run.Status.Class.Name,
		depth: run.Spec.ParentRef.Depth, budgetRef: ref.Name, cappedCents: notNull(budget["capCents"]),
		cappedTokens: notNull(budget["maxTokens"])}, nil
}

// notNull says whether a raw JSON member is there and not null.
func notNull(raw json.RawMessage) bool {
	return len(raw) > 0 && string(raw) != "null"
}

// childSpec is the child's spec as the caller asked for it, the digest's input: it has no
// parentRef, which names the attempt and changes when a resumed attempt re-attaches. The child
// draws on its parent's WorkerBudget, and a capped parent's child names its share of each cap.
func childSpec(p parentRun, opts SpawnOptions) (map[string]any, error) {
	extra, err := plainJSON(opts.Spec)
	if err != nil {
		return nil, err
	}
	spec := map[string]any{"executor": "Pod"}
	maps.Copy(spec, extra)
	if opts.ClassName != "" {
		spec["className"] = opts.ClassName
	}
	if opts.Payload != nil {
		spec["payload"] = opts.Payload
	}
	budget := map[string]any{}
	if asked, ok := spec["budget"].(map[string]any); ok {
		maps.Copy(budget, asked)
	}
	if opts.CapCents != nil {
		budget["capCents"] = *opts.CapCents
	}
	if opts.MaxTokens != nil {
		budget["maxTokens"] = *opts.MaxTokens
	}
	if _, ok := budget["budgetRef"]; !ok && p.budgetRef != "" {
		budget["budgetRef"] = map[string]any{"name": p.budgetRef}
	}
	if _, ok := budget["capCents"]; p.cappedCents && !ok {
		return nil, fmt.Errorf("tether: run %s has a cap in cents: a child names its share of it (CapCents)", p.name)
	}
	if _, ok := budget["maxTokens"]; p.cappedTokens && !ok {
		return nil, fmt.Errorf("tether: run %s has a token cap: a child names its share of it (MaxTokens)", p.name)
	}
	if len(budget) > 0 {
		spec["budget"] = budget
	}
	return plainJSON(spec)
}

// childBody is the whole child WorkerRun a pod's spawn creates: spec, the parentRef naming the
// attempt that spawns it, the parent's label and owner reference, and the key and digest.
func childBody(p parentRun, namespace, holder string, fence int64, key string, generation int,
	spec map[string]any) map[string]any {
	ref := map[string]any{"name": p.name, "uid": p.uid, "holder": holder, "fence": fence, "depth": p.depth + 1}
	if p.className != "" {
		ref["className"] = p.className
	}
	withRef := maps.Clone(spec)
	withRef["parentRef"] = ref
	apiVersion := workerRunsGV.String()
	return map[string]any{"apiVersion": apiVersion, "kind": "WorkerRun",
		"metadata": map[string]any{"name": childName(p.name, p.uid, key, generation), "namespace": namespace,
			"labels":      map[string]any{labelParent: p.name},
			"annotations": map[string]any{annChildKey: key, annSpawnDigest: spawnDigest(spec)},
			"ownerReferences": []any{map[string]any{"apiVersion": apiVersion, "kind": "WorkerRun", "name": p.name,
				"uid": p.uid, "controller": true}}},
		"spec": withRef}
}

// childView is what a parent reads of a child run.
type childView struct {
	Metadata struct {
		Name            string            `json:"name"`
		Labels          map[string]string `json:"labels"`
		Annotations     map[string]string `json:"annotations"`
		OwnerReferences []ownerReference  `json:"ownerReferences"`
	} `json:"metadata"`
	Spec struct {
		ParentRef struct {
			Holder string `json:"holder"`
			Fence  int64  `json:"fence"`
		} `json:"parentRef"`
	} `json:"spec"`
	Status struct {
		Phase      string         `json:"phase"`
		Attempt    int64          `json:"attempt"`
		Result     map[string]any `json:"result"`
		Error      map[string]any `json:"error"`
		Conditions []struct {
			Type    string `json:"type"`
			Reason  string `json:"reason"`
			Message string `json:"message"`
		} `json:"conditions"`
	} `json:"status"`
}

// parseChild reads an answer as a WorkerRun: a JSON object with a string metadata.name. An error
// says it is not one (a proxy's page, its `{}`): no answer.
func parseChild(raw []byte) (*childView, error) {
	var view *childView
	if err := json.Unmarshal(raw, &view); err != nil || view == nil || view.Metadata.Name == "" {
		return nil, fmt.Errorf("tether: the answer is not a WorkerRun: %q", clip(string(raw)))
	}
	return view, nil
}

// conflict says why a run found for a key is not that key's child: it is not this parent's (its
// owner reference and label), or it was asked for another spec (its digest). Nil when it is.
func (v *childView) conflict(p parentRun, key, digest string) error {
	owned := slices.ContainsFunc(v.Metadata.OwnerReferences, func(o ownerReference) bool { return o.UID == p.uid })
	if !owned || v.Metadata.Labels[labelParent] != p.name {
		return fmt.Errorf("%w: %s exists and is not a child of %s", ErrSpawnConflict, v.Metadata.Name, p.name)
	}
	if v.Metadata.Annotations[annSpawnDigest] != digest {
		return fmt.Errorf("%w: key %q was spawned before as %s with another spec (class, payload, caps): "+
			"one key is one tool call", ErrSpawnConflict, key, v.Metadata.Name)
	}
	return nil
}

// spawnedBy says whether this attempt spawned the child (its parentRef names the attempt).
func (v *childView) spawnedBy(holder string, fence int64) bool {
	return v.Spec.ParentRef.Holder == holder && v.Spec.ParentRef.Fence == fence
}

// staleRejected says whether the operator rejected the child as a stale attempt's before it ever
// ran: its key moves on to the next generation.
func (v *childView) staleRejected() bool {
	return v.Status.Phase == "Rejected" && v.reason() == staleParent && v.Status.Attempt == 0
}

func (v *childView) ended() bool { return slices.Contains(terminalPhases, v.Status.Phase) }

// ready is the child's Ready condition's reason and message ("" when it has none).
func (v *childView) ready() (reason, message string) {
	for _, c := range v.Status.Conditions {
		if c.Type == "Ready" {
			return c.Reason, c.Message
		}
	}
	return "", ""
}

// reason is why the child is where it is: its Ready condition's reason (StaleParent,
// TreeBudgetExhausted, ...), else its phase.
func (v *childView) reason() string {
	if reason, _ := v.ready(); reason != "" {
		return reason
	}
	return v.Status.Phase
}

// outcome is an ended child's result once it Succeeded, a *ChildFailedError for any other end.
func (v *childView) outcome() (map[string]any, error) {
	if v.Status.Phase == "Succeeded" {
		if v.Status.Result == nil {
			return map[string]any{}, nil
		}
		return v.Status.Result, nil
	}
	_, message := v.ready()
	return nil, &ChildFailedError{Name: v.Metadata.Name, Phase: v.Status.Phase, Reason: v.reason(), Message: message,
		Failure: v.Status.Error}
}
