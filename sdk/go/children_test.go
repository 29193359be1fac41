package tether

// Child runs (docs/children.md): the names, digests, parents and bodies every SDK computes alike
// (sdk/vectors/children.json), and the Run's spawn and wait against an in-memory API that stores
// what a spawn creates as the API server does.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

type childVectors struct {
	Names []struct {
		Parent, UID, Key, Name string
		Generation             int
	}
	Digests []struct {
		Spec   map[string]any
		Digest string
	}
	Parents []struct {
		Run    json.RawMessage
		Parent struct {
			Name, UID                 string
			ClassName, BudgetRef      string // null: ""
			Depth                     int64
			CappedCents, CappedTokens bool
		}
	}
	Bodies []struct {
		Parent int
		Ask    struct {
			ClassName           string // null: ""
			Payload, Spec       map[string]any
			CapCents, MaxTokens *int64
		}
		Holder, Key, Refused string
		Fence                int64
		Generation           int
		Spec, Body           json.RawMessage
	}
}

// readChildVectors reads the vectors with numbers as they are written (json.Number), as childSpec
// makes them.
func readChildVectors(t *testing.T) childVectors {
	t.Helper()
	raw, err := os.ReadFile("../vectors/children.json")
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v childVectors
	if err := dec.Decode(&v); err != nil {
		t.Fatalf("vectors: %v", err)
	}
	return v
}

func TestChildNamesAndDigestsAreEverySDKs(t *testing.T) {
	v := readChildVectors(t)
	if len(v.Names) < 5 || len(v.Digests) < 2 {
		t.Fatalf("%d names, %d digests", len(v.Names), len(v.Digests))
	}
	for _, n := range v.Names {
		if got := childName(n.Parent, n.UID, n.Key, n.Generation); got != n.Name {
			t.Errorf("childName(%q, %q, %q, %d) = %q, want %q", n.Parent, n.UID, n.Key, n.Generation, got, n.Name)
		}
	}
	for _, d := range v.Digests {
		if got := spawnDigest(d.Spec); got != d.Digest {
			t.Errorf("spawnDigest(%v) = %s, want %s", d.Spec, got, d.Digest)
		}
	}
}

func TestChildParentsAndBodiesAreEverySDKs(t *testing.T) {
	v := readChildVectors(t)
	var parents []parentRun
	for _, p := range v.Parents {
		got, err := parentOf(p.Run)
		if err != nil {
			t.Fatal(err)
		}
		w := p.Parent
		want := parentRun{name: w.Name, uid: w.UID, className: w.ClassName, depth: w.Depth,
			budgetRef: w.BudgetRef, cappedCents: w.CappedCents, cappedTokens: w.CappedTokens}
		if got != want {
			t.Errorf("parentOf(%s) = %+v, want %+v", p.Run, got, want)
		}
		parents = append(parents, got)
	}
	refused, made := 0, 0
	for i, b := range v.Bodies {
		p := parents[b.Parent]
		opts := SpawnOptions{ClassName: b.Ask.ClassName, Payload: b.Ask.Payload, CapCents: b.Ask.CapCents,
			MaxTokens: b.Ask.MaxTokens, Spec: b.Ask.Spec}
		spec, err := childSpec(p, opts)
		if b.Refused != "" {
			// The Python SDK names its own arguments (cap_cents), this one its options (CapCents).
			why, _, _ := strings.Cut(b.Refused, " (")
			if err == nil || !strings.Contains(err.Error(), why) {
				t.Errorf("body %d: %v, want %q", i, err, b.Refused)
			}
			refused++
			continue
		}
		if err != nil {
			t.Fatalf("body %d: %v", i, err)
		}
		if !jsonEqual(mustJSON(t, spec), b.Spec) {
			t.Errorf("body %d: spec %s, want %s", i, mustJSON(t, spec), b.Spec)
		}
		body := childBody(p, "team-a", b.Holder, b.Fence, b.Key, b.Generation, spec)
		if !jsonEqual(mustJSON(t, body), b.Body) {
			t.Errorf("body %d: %s, want %s", i, mustJSON(t, body), b.Body)
		}
		made++
	}
	if refused == 0 || made < 3 {
		t.Fatalf("%d refused, %d made: the vectors lost their cases", refused, made)
	}
}

// TestTheDigestIsPythons: the spec as Python's json.dumps writes it, U+2028 included (encoding/json
// escapes it), whatever the Go types and the order of the keys.
func TestTheDigestIsPythons(t *testing.T) {
	a, err := plainJSON(map[string]any{"b": []int64{1, 2}, "a": "line\u2028sep <&>", "c": nil})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	writeCanonical(&b, a)
	if want := "{\"a\":\"line\u2028sep <&>\",\"b\":[1,2],\"c\":null}"; b.String() != want {
		t.Fatalf("%s, want %s", b.String(), want)
	}
	other, _ := plainJSON(map[string]any{"c": nil, "a": "line\u2028sep <&>", "b": []any{1, 2}})
	if spawnDigest(a) != spawnDigest(other) {
		t.Fatal("one spec, two digests")
	}
}

// TestNumbersAreDigestedAsPythonWritesThem: what Python's json.dumps(json.loads(text)) writes.
func TestNumbersAreDigestedAsPythonWritesThem(t *testing.T) {
	for text, want := range map[string]string{
		"0.00001": "1e-05", "0.0001": "0.0001", "1e-07": "1e-07", "1.5": "1.5", "3.0": "3.0", "1e16": "1e+16",
		"1.5e+16": "1.5e+16", "123456789.125": "123456789.125", "1e21": "1e+21", "1e+300": "1e+300", "-0.0": "-0.0",
		"-2.5e-05": "-2.5e-05", "100": "100", "12345678901234567890": "12345678901234567890", "0.1": "0.1",
		"1E5": "100000.0", "2.5E-3": "0.0025",
	} {
		if got := pythonNumber(json.Number(text)); got != want {
			t.Errorf("pythonNumber(%s) = %s, want %s", text, got, want)
		}
	}
}

// childAPI keeps runs by name as the API server does for a spawn: the first body made stays, and a
// spawn of a name that exists answers that run (a POST's 409, then the GET); a test judges, ends or
// deletes them.
type childAPI struct {
	t      *testing.T
	parent parentRun
	mu     sync.Mutex
	runs   map[string]map[string]any
	posts  int
	refuse string            // when set, every spawn is refused with it
	onRead func(name string) // called before each read answers
	reads  map[string]int    // reads per name
}

func newChildAPI(t *testing.T) *childAPI {
	return &childAPI{t: t, runs: map[string]map[string]any{}, reads: map[string]int{},
		parent: parentRun{name: "planner", uid: "u-p", className: "planners", budgetRef: "team", cappedCents: true}}
}

// childClient is the API as one attempt of the parent reaches it: its spawns name that attempt.
type childClient struct {
	api    *childAPI
	holder string
	fence  int64
}

func (c *childClient) spawn(req spawnRequest) (*childView, error) {
	body := childBody(req.parent, "ns", c.holder, c.fence, req.key, req.generation, req.spec)
	a := c.api
	a.mu.Lock()
	defer a.mu.Unlock()
	a.posts++
	if a.refuse != "" {
		return nil, fmt.Errorf("%w: %s", ErrSpawnRefused, a.refuse)
	}
	name := body["metadata"].(map[string]any)["name"].(string)
	if _, ok := a.runs[name]; !ok {
		a.runs[name] = a.asRead(body)
	}
	return parseChild(mustJSON(a.t, a.runs[name]))
}

func (a *childAPI) read(name string) (*childView, error) {
	if a.onRead != nil {
		a.onRead(name)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	a.reads[name]++
	run, ok := a.runs[name]
	if !ok {
		return nil, nil
	}
	return parseChild(mustJSON(a.t, run))
}

// set replaces a run's status.
func (a *childAPI) set(name string, status map[string]any) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.runs[name]["status"] = status
}

// end sets a run's status as the operator does when it ends it: the phase, Ready's reason (the
// phase's unless given) and message, and the other fields given.
func (a *childAPI) end(name, phase, reason string, fields map[string]any) {
	if reason == "" {
		reason = phase
	}
	status := map[string]any{"phase": phase, "conditions": []any{map[string]any{"type": "Ready", "status": "False",
		"reason": reason, "message": "it ended " + phase}}}
	for k, v := range fields {
		status[k] = v
	}
	a.set(name, status)
}

func (a *childAPI) stored(name string) map[string]any {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.asRead(a.runs[name])
}

func (a *childAPI) count() (runs, posts int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.runs), a.posts
}

// asRead is v as a read decodes it (a deep copy).
func (a *childAPI) asRead(v any) map[string]any {
	var out map[string]any
	if err := json.Unmarshal(mustJSON(a.t, v), &out); err != nil {
		a.t.Fatal(err)
	}
	return out
}

// parentAttempt is attempt N of the run planner (holder planner-aN), with fence, on the API.
func parentAttempt(t *testing.T, api *childAPI, attempt int, fence int64) (*Run, *fakeTransport) {
	t.Helper()
	info := attemptInfo{name: "planner", namespace: "ns", holder: fmt.Sprintf("planner-a%d", attempt), fence: fence,
		attempt: attempt, leaseDuration: 10 * time.Second, renewInterval: time.Hour}
	tr := &fakeTransport{children: &childClient{api: api, holder: info.holder, fence: fence}}
	r, _ := testRunOf(t, info, tr, &fakeClock{})
	return r, tr
}

func int64p(n int64) *int64 { return &n }

// earlierChild is the shell call as attempt 2 (fence 3) of the planner spawned it.
func earlierChild(t *testing.T, api *childAPI) *Child {
	t.Helper()
	first, _ := parentAttempt(t, api, 2, 3)
	child, err := spawnShell(first)
	if err != nil {
		t.Fatal(err)
	}
	return child
}

// spawnShell spawns the scenarios' one shell call, a child of class shell with a 5-cent share.
func spawnShell(r *Run) (*Child, error) {
	return r.Spawn(context.Background(), "shell:1", SpawnOptions{ClassName: "shell", CapCents: int64p(5)})
}

func search(q string) SpawnOptions {
	return SpawnOptions{ClassName: "search", Payload: map[string]any{"q": q}, CapCents: int64p(20)}
}

func TestASpawnNamesItsParentTheAttemptAndTheKey(t *testing.T) {
	api := newChildAPI(t)
	r, _ := parentAttempt(t, api, 2, 3)
	child, err := r.Spawn(context.Background(), "search:1", search("tether"))
	if err != nil {
		t.Fatal(err)
	}
	if child.Name() != childName("planner", "u-p", "search:1", 0) || child.Key() != "search:1" || child.Phase() != "" {
		t.Fatalf("child %s, key %s, phase %q", child.Name(), child.Key(), child.Phase())
	}
	body := api.stored(child.Name())
	spec, meta := body["spec"].(map[string]any), body["metadata"].(map[string]any)
	wantRef := `{"name":"planner","uid":"u-p","holder":"planner-a2","fence":3,"depth":1,"className":"planners"}`
	if !jsonEqual(mustJSON(t, spec["parentRef"]), json.RawMessage(wantRef)) ||
		!jsonEqual(mustJSON(t, spec["budget"]), json.RawMessage(`{"capCents":20,"budgetRef":{"name":"team"}}`)) ||
		!jsonEqual(mustJSON(t, meta["labels"]), json.RawMessage(`{"tether.dev/parent":"planner"}`)) {
		t.Fatalf("body %s", mustJSON(t, body))
	}
}

func TestAResumedAttemptFindsItsChildByKeyAndAKeyIsOneCall(t *testing.T) {
	api := newChildAPI(t)
	ctx := context.Background()
	first, _ := parentAttempt(t, api, 2, 3)
	made, err := first.Spawn(ctx, "search:1", search("tether"))
	if err != nil {
		t.Fatal(err)
	}
	again, err := first.Spawn(ctx, "search:1", search("tether"))
	if err != nil || again.Name() != made.Name() {
		t.Fatalf("spawned again: %v, %v", again, err)
	}
	api.set(made.Name(), map[string]any{"phase": "Running", "attempt": 1}) // admitted, and running
	// The parent's next attempt, resumed from its checkpoint, spawns the same call again.
	next, _ := parentAttempt(t, api, 3, 5)
	found, err := next.Spawn(ctx, "search:1", search("tether"))
	if err != nil || found.Name() != made.Name() || found.Phase() != "Running" {
		t.Fatalf("the resumed attempt's spawn: %v, %v", found, err)
	}
	if holder := api.stored(made.Name())["spec"].(map[string]any)["parentRef"].(map[string]any)["holder"]; holder != "planner-a2" {
		t.Fatalf("the child names %v: made again", holder)
	}
	if _, err := next.Spawn(ctx, "search:1", search("other")); !errors.Is(err, ErrSpawnConflict) ||
		!strings.Contains(err.Error(), "another spec") {
		t.Fatalf("the same key with another payload: %v", err)
	}
	if runs, _ := api.count(); runs != 1 {
		t.Fatalf("%d children for one key", runs)
	}
}

func TestARunOfTheChildsNameThatIsNotItsChildIsAConflict(t *testing.T) {
	api := newChildAPI(t)
	name := childName("planner", "u-p", "search:1", 0)
	api.runs[name] = map[string]any{"metadata": map[string]any{"name": name, "labels": map[string]any{labelParent: "planner"},
		"ownerReferences": []any{map[string]any{"uid": "u-other"}}}}
	r, _ := parentAttempt(t, api, 2, 3)
	if _, err := r.Spawn(context.Background(), "search:1", search("tether")); !errors.Is(err, ErrSpawnConflict) ||
		!strings.Contains(err.Error(), "not a child of planner") {
		t.Fatalf("spawn over another's run: %v", err)
	}
}

func TestAStaleAttemptsRejectedChildMovesTheKeyOn(t *testing.T) {
	api := newChildAPI(t)
	ctx := context.Background()
	shell := SpawnOptions{ClassName: "shell", CapCents: int64p(5)}
	first, _ := parentAttempt(t, api, 2, 3)
	stale, err := first.Spawn(ctx, "shell:1", shell)
	if err != nil {
		t.Fatal(err)
	}
	api.end(stale.Name(), "Rejected", staleParent, nil)
	next, _ := parentAttempt(t, api, 3, 5)
	child, err := next.Spawn(ctx, "shell:1", shell)
	if err != nil || child.Name() != childName("planner", "u-p", "shell:1", 1) {
		t.Fatalf("spawned %v, %v: want generation 1", child, err)
	}
	// Again from the same attempt: the same generation, not a third.
	if again, err := next.Spawn(ctx, "shell:1", shell); err != nil || again.Name() != child.Name() {
		t.Fatalf("spawned again %v, %v", again, err)
	}
	// A child rejected for another reason, or one that ran, keeps its key: its end is the answer.
	api.end(child.Name(), "Rejected", "TreeBudgetExhausted", nil)
	later, _ := parentAttempt(t, api, 4, 7)
	_, err = later.Call(ctx, "shell:1", shell, time.Millisecond)
	var failed *ChildFailedError
	if !errors.As(err, &failed) || !errors.Is(err, ErrChildFailed) || failed.Phase != "Rejected" ||
		failed.Reason != "TreeBudgetExhausted" || failed.Name != child.Name() {
		t.Fatalf("call: %v", err)
	}
	if runs, _ := api.count(); runs != 2 {
		t.Fatalf("%d children", runs)
	}
}

// TestAResumedAttemptWaitsForTheOperatorsWord: an earlier attempt's child that the operator has not
// judged yet is read until it is (admitted: it is this call's; rejected as stale: the key moves on).
func TestAResumedAttemptWaitsForTheOperatorsWord(t *testing.T) {
	for _, tc := range []struct {
		name, phase, reason string
		generation          int
	}{
		{"admitted", "Pending", "", 0},
		{"rejected as a stale attempt's", "Rejected", staleParent, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			api := newChildAPI(t)
			earlier := earlierChild(t, api)
			api.onRead = func(name string) {
				if api.reads[name] == 2 { // judged at the third read
					api.end(name, tc.phase, tc.reason, nil)
				}
			}
			next, _ := parentAttempt(t, api, 3, 5)
			child, err := spawnShell(next)
			if err != nil || child.Name() != childName("planner", "u-p", "shell:1", tc.generation) {
				t.Fatalf("spawned %v, %v", child, err)
			}
			if reads := api.reads[earlier.Name()]; reads != 3 {
				t.Fatalf("%d reads of the earlier attempt's child", reads)
			}
		})
	}
}

func TestAChildNeverJudgedIsAConflictAfterAMinute(t *testing.T) {
	api := newChildAPI(t)
	earlier := earlierChild(t, api)
	next, _ := parentAttempt(t, api, 3, 5)
	_, err := spawnShell(next)
	if !errors.Is(err, ErrSpawnConflict) || !strings.Contains(err.Error(), "not judged") {
		t.Fatalf("spawn: %v", err)
	}
	if reads := api.reads[earlier.Name()]; reads != int(judgedWithin/judgePoll) {
		t.Fatalf("%d reads in a minute", reads)
	}
}

func TestAChildDeletedWhileWaitedForIsMadeAgain(t *testing.T) {
	api := newChildAPI(t)
	earlier := earlierChild(t, api)
	api.onRead = func(name string) {
		api.mu.Lock()
		delete(api.runs, name)
		api.mu.Unlock()
	}
	next, _ := parentAttempt(t, api, 3, 5)
	child, err := spawnShell(next)
	if err != nil || child.Name() != earlier.Name() {
		t.Fatalf("spawned %v, %v: want the same generation", child, err)
	}
	if holder := api.stored(child.Name())["spec"].(map[string]any)["parentRef"].(map[string]any)["holder"]; holder != "planner-a3" {
		t.Fatalf("made again by %v", holder)
	}
}

func TestASpawnRefusedCreatesNothing(t *testing.T) {
	api := newChildAPI(t)
	r, _ := parentAttempt(t, api, 2, 3)
	ctx := context.Background()
	if _, err := r.Spawn(ctx, "search:1", SpawnOptions{ClassName: "search"}); err == nil ||
		!strings.Contains(err.Error(), "names its share of it (CapCents)") || errors.Is(err, ErrSpawnRefused) {
		t.Fatalf("a capped run's child without its share: %v", err)
	}
	if _, err := r.Spawn(ctx, "no spaces", search("x")); err == nil || !strings.Contains(err.Error(), "child key") {
		t.Fatalf("a malformed key: %v", err)
	}
	api.refuse = "WorkerClass planners lets its runs spawn children of the classes search only"
	if _, err := r.Spawn(ctx, "shell:1", search("x")); !errors.Is(err, ErrSpawnRefused) ||
		!strings.Contains(err.Error(), "search only") || r.Lost() {
		t.Fatalf("refused: %v (%s)", err, state(r))
	}
	if runs, _ := api.count(); runs != 0 {
		t.Fatalf("%d children", runs)
	}
}

func TestTheParentIsReadOnce(t *testing.T) {
	api := newChildAPI(t)
	r, _ := parentAttempt(t, api, 2, 3)
	for _, key := range []string{"a", "b"} {
		if _, err := r.Spawn(context.Background(), key, search(key)); err != nil {
			t.Fatal(err)
		}
	}
	api.parent.uid = "u-changed" // read again, it would name other children
	if child, err := r.Spawn(context.Background(), "a", search("a")); err != nil ||
		child.Name() != childName("planner", "u-p", "a", 0) {
		t.Fatalf("spawned %v, %v", child, err)
	}
}

func TestALostOrStoppingAttemptSpawnsNothing(t *testing.T) {
	for _, tc := range []struct {
		name   string
		answer renewResult
		want   error
	}{
		{"lost", renewResult{lost: true, why: "gone"}, ErrLeaseLost},
		{"told to stop", renewResult{ok: true, signals: &signalState{Stop: true}}, ErrStopRequested},
	} {
		t.Run(tc.name, func(t *testing.T) {
			api := newChildAPI(t)
			r, tr := parentAttempt(t, api, 2, 3)
			tr.mu.Lock()
			tr.renewFn = func(int) (renewResult, error) { return tc.answer, nil }
			tr.mu.Unlock()
			_ = r.Checkpoint("1", true)
			if _, err := r.Spawn(context.Background(), "search:1", search("x")); !errors.Is(err, tc.want) {
				t.Fatalf("spawn: %v", err)
			}
			if _, posts := api.count(); posts != 0 {
				t.Fatalf("%d spawns sent", posts)
			}
		})
	}
}

func TestResultWaitsForTheChildsEnd(t *testing.T) {
	api := newChildAPI(t)
	r, _ := parentAttempt(t, api, 2, 3)
	child, err := r.Spawn(context.Background(), "search:1", search("x"))
	if err != nil {
		t.Fatal(err)
	}
	api.onRead = func(name string) {
		if api.reads[name] == 2 {
			api.end(name, "Succeeded", "", map[string]any{"result": map[string]any{"hits": 3}})
		}
	}
	got, err := child.Result(context.Background(), 10*time.Millisecond)
	if err != nil || !jsonEqual(mustJSON(t, got), json.RawMessage(`{"hits":3}`)) || child.Phase() != "Succeeded" {
		t.Fatalf("result %v, %v (phase %s)", got, err, child.Phase())
	}
	if reads := api.reads[child.Name()]; reads != 3 {
		t.Fatalf("%d reads", reads)
	}
}

func TestResultOfAChildThatEndedWithoutOne(t *testing.T) {
	api := newChildAPI(t)
	r, _ := parentAttempt(t, api, 2, 3)
	child, err := r.Spawn(context.Background(), "search:1", search("x"))
	if err != nil {
		t.Fatal(err)
	}
	api.end(child.Name(), "Failed", "WorkerFailed", map[string]any{"error": map[string]any{"code": "Boom", "message": "no"}})
	_, err = child.Result(context.Background(), time.Millisecond)
	var failed *ChildFailedError
	if !errors.As(err, &failed) || failed.Phase != "Failed" || failed.Reason != "WorkerFailed" ||
		failed.Message != "it ended Failed" || failed.Failure["code"] != "Boom" {
		t.Fatalf("result: %#v", err)
	}
	api.mu.Lock()
	delete(api.runs, child.Name())
	api.mu.Unlock()
	if _, err = child.Result(context.Background(), time.Millisecond); !errors.As(err, &failed) ||
		failed.Phase != "Deleted" || failed.Reason != "Deleted" {
		t.Fatalf("result of a deleted child: %v", err)
	}
}

func TestTheResultReachesOnlyAnAttemptThatHoldsTheRun(t *testing.T) {
	api := newChildAPI(t)
	r, tr := parentAttempt(t, api, 2, 3)
	child, err := r.Spawn(context.Background(), "search:1", search("x"))
	if err != nil {
		t.Fatal(err)
	}
	api.end(child.Name(), "Succeeded", "", map[string]any{"result": map[string]any{"hits": 3}})
	tr.mu.Lock()
	tr.renewFn = func(int) (renewResult, error) { return renewResult{lost: true, why: "gone"}, nil }
	tr.mu.Unlock()
	_ = r.Checkpoint("1", true)
	if _, err := child.Result(context.Background(), time.Millisecond); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("result: %v", err)
	}
}

func TestResultEndsWithItsContext(t *testing.T) {
	api := newChildAPI(t)
	r, _ := parentAttempt(t, api, 2, 3)
	r.sleep = sleepCtx // the test's sleep returns at once
	child, err := r.Spawn(context.Background(), "search:1", search("x"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := child.Result(ctx, 10*time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("result: %v", err)
	}
}
