package tether

// The metering RoundTripper against a fake model API (httptest): sdk/vectors/metering.json, whole
// and streamed answers, gzip, cut and abandoned streams, hostile usage, error answers, concurrency.

import (
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

var testPrices = map[string]ModelPrice{
	"gpt-x":    {Input: 2.5, Output: 10, CachedInput: 1.25},
	"claude-x": {Input: 3, Output: 15, CachedInput: 0.3, CacheWrite: 3.75},
}

// reporter takes reports as Run does: a decrease is refused.
type reporter struct {
	mu      sync.Mutex
	reports [][2]int64
}

func (r *reporter) ReportUsage(cents, tokens int64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var last *usage
	if n := len(r.reports); n > 0 {
		last = &usage{Cents: r.reports[n-1][0], Tokens: r.reports[n-1][1]}
	}
	if why := validReport(usage{Cents: cents, Tokens: tokens}, last); why != "" {
		return fmt.Errorf("%w: %s", ErrUsageRefused, why)
	}
	r.reports = append(r.reports, [2]int64{cents, tokens})
	return nil
}

func (r *reporter) last() [2]int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.reports) == 0 {
		return [2]int64{}
	}
	return r.reports[len(r.reports)-1]
}

type knobs struct {
	usage    any
	hasUsage bool
	status   int
	gzip     bool
	cutAfter int // 0: no cut; n: cut inside event n-1
	cutBody  int // 0: no cut; n: a whole answer cut after n bytes of its body (Content-Length promises all)
	model    string
	body     string
	hold     chan struct{}
}

type fakeModel struct {
	*httptest.Server
	mu       sync.Mutex
	queue    []knobs
	requests []map[string]any
}

func (f *fakeModel) next(k knobs) { f.mu.Lock(); f.queue = append(f.queue, k); f.mu.Unlock() }
func (f *fakeModel) count() int   { f.mu.Lock(); defer f.mu.Unlock(); return len(f.requests) }

func newFakeModel(t *testing.T) *fakeModel {
	f := &fakeModel{}
	f.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var body map[string]any
		_ = json.NewDecoder(r.Body).Decode(&body)
		f.mu.Lock()
		f.requests = append(f.requests, body)
		k := knobs{}
		if len(f.queue) > 0 {
			k, f.queue = f.queue[0], f.queue[1:]
		}
		f.mu.Unlock()
		serve(w, r.URL.Path, body, k)
	}))
	t.Cleanup(f.Close)
	return f
}

func serve(w http.ResponseWriter, path string, body map[string]any, k knobs) {
	model, _ := body["model"].(string)
	if k.model != "" {
		model = k.model
	}
	anthropic, responses := strings.HasSuffix(path, "/messages"), strings.HasSuffix(path, "/responses")
	var u any = map[string]any{"prompt_tokens": 1000, "completion_tokens": 500, "total_tokens": 1500}
	if anthropic {
		u = map[string]any{"input_tokens": 1000, "output_tokens": 500, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
	} else if responses {
		u = map[string]any{"input_tokens": 1000, "input_tokens_details": map[string]any{"cached_tokens": 0}, "output_tokens": 500, "total_tokens": 1500}
	}
	if k.hasUsage {
		u = k.usage
	}
	send := func(status int, data []byte, ctype string) {
		w.Header().Set("Content-Type", ctype)
		if k.gzip {
			var b bytes.Buffer
			z := gzip.NewWriter(&b)
			z.Write(data)
			z.Close()
			data = b.Bytes()
			w.Header().Set("Content-Encoding", "gzip")
		}
		if k.cutBody > 0 {
			w.Header().Set("Content-Length", strconv.Itoa(len(data)))
			w.WriteHeader(status)
			w.Write(data[:k.cutBody])
			w.(http.Flusher).Flush()
			conn, _, _ := w.(http.Hijacker).Hijack() // the connection drops, the body short of its length
			conn.Close()
			return
		}
		w.WriteHeader(status)
		w.Write(data)
	}
	if k.body != "" {
		send(max(k.status, 200), []byte(k.body), "text/html")
		return
	}
	if k.status >= 400 {
		doc := map[string]any{"error": map[string]any{"message": "injected"}}
		if k.hasUsage {
			doc["usage"] = u
		}
		b, _ := json.Marshal(doc)
		send(k.status, b, "application/json")
		return
	}
	if body["stream"] != true {
		b, _ := json.Marshal(map[string]any{"id": "x", "model": model, "usage": u})
		send(200, b, "application/json")
		return
	}
	type ev struct {
		name string
		data any
	}
	var evs []ev
	switch {
	case anthropic:
		start := u
		if m, ok := u.(map[string]any); ok && !k.hasUsage {
			s := map[string]any{}
			for kk, v := range m {
				s[kk] = v
			}
			s["output_tokens"] = 1
			start = s
		}
		delta := any(map[string]any{"output_tokens": 500})
		if k.hasUsage {
			delta = u
		}
		evs = []ev{{"message_start", map[string]any{"type": "message_start", "message": map[string]any{"model": model, "usage": start}}},
			{"content_block_delta", map[string]any{"delta": map[string]any{"text": "Hel"}}},
			{"content_block_delta", map[string]any{"delta": map[string]any{"text": "lo"}}},
			{"message_delta", map[string]any{"type": "message_delta", "usage": delta}},
			{"message_stop", map[string]any{"type": "message_stop"}}}
	case responses:
		evs = []ev{{"response.created", map[string]any{"response": map[string]any{"model": model, "usage": nil}}},
			{"response.output_text.delta", map[string]any{"delta": "Hi"}},
			{"response.completed", map[string]any{"response": map[string]any{"model": model, "usage": u}}}}
	default:
		opts, _ := body["stream_options"].(map[string]any)
		with := opts != nil && opts["include_usage"] == true
		for _, word := range []string{"Hel", "lo"} {
			c := map[string]any{"model": model, "choices": []any{map[string]any{"delta": map[string]any{"content": word}}}}
			if with {
				c["usage"] = nil
			}
			evs = append(evs, ev{"", c})
		}
		if with {
			evs = append(evs, ev{"", map[string]any{"model": model, "choices": []any{}, "usage": u}})
		}
		evs = append(evs, ev{"", "[DONE]"})
	}
	w.Header().Set("Content-Type", "text/event-stream")
	var out io.Writer = w
	var z *gzip.Writer
	if k.gzip {
		w.Header().Set("Content-Encoding", "gzip")
		z = gzip.NewWriter(w)
		out = z
	}
	w.WriteHeader(200)
	flush := func() {
		if z != nil {
			z.Flush()
		}
		w.(http.Flusher).Flush()
	}
	for i, e := range evs {
		data, _ := json.Marshal(e.data)
		if s, ok := e.data.(string); ok {
			data = []byte(s)
		}
		event := fmt.Sprintf("data: %s\n\n", data)
		if e.name != "" {
			event = "event: " + e.name + "\n" + event
		}
		if k.cutAfter == i+1 {
			io.WriteString(out, event[:len(event)/2])
			flush()
			conn, _, _ := w.(http.Hijacker).Hijack()
			conn.Close()
			return
		}
		io.WriteString(out, event)
		flush()
		if i == 0 && k.hold != nil {
			<-k.hold
		}
	}
	if z != nil {
		z.Close()
	}
}

func post(t *testing.T, c *http.Client, url string, body map[string]any) (*http.Response, error) {
	t.Helper()
	b, _ := json.Marshal(body)
	return c.Post(url, "application/json", bytes.NewReader(b))
}

func postText(t *testing.T, c *http.Client, url string, body map[string]any) string {
	t.Helper()
	resp, err := post(t, c, url, body)
	return readAll(t, resp, err)
}

func meterFor(t *testing.T) (*Meter, *reporter, *http.Client) {
	r := &reporter{}
	m, err := NewMeter(r, testPrices)
	if err != nil {
		t.Fatal(err)
	}
	m.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	return m, r, &http.Client{Transport: m.Transport(nil)}
}

func readAll(t *testing.T, resp *http.Response, err error) string {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return string(b)
}

type vectors struct {
	Prices  map[string]map[string]any `json:"prices"`
	Lookups []struct {
		Model string  `json:"model"`
		Key   *string `json:"key"`
	} `json:"lookups"`
	Usages []struct {
		Name      string `json:"name"`
		Model     string `json:"model"`
		Usage     any    `json:"usage"`
		Units     int64  `json:"units"`
		Tokens    int64  `json:"tokens"`
		Malformed bool   `json:"malformed"`
	} `json:"usages"`
	Caps []struct {
		Name               string   `json:"name"`
		CapRemainingCents  *int64   `json:"capRemainingCents"`
		CapRemainingTokens *int64   `json:"capRemainingTokens"`
		Reported           [2]int64 `json:"reported"`
		RefusedAtStart     bool     `json:"refusedAtStart"`
		Steps              []struct {
			Add     [2]int64 `json:"add"`
			Refused bool     `json:"refused"`
			Wakes   bool     `json:"wakes"`
		} `json:"steps"`
	} `json:"caps"`
	Cuts []cutCase `json:"cuts"`
}

type cutCase struct {
	Name        string         `json:"name"`
	Path        string         `json:"path"`
	Request     map[string]any `json:"request"`
	Status      int            `json:"status"`
	ContentType string         `json:"contentType"`
	Body        string         `json:"body"`
	CutAt       int            `json:"cutAt"`
	Faults      bool           `json:"faults"`
	Charged     [2]int64       `json:"charged"`
}

func TestMeteringVectors(t *testing.T) {
	v := loadVectors(t)
	prices := vectorPrices(t, v)
	table, err := NewPriceTable(prices)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range v.Lookups {
		want := ""
		if c.Key != nil {
			want = *c.Key
		}
		if got := table.Key(c.Model); got != want {
			t.Errorf("%q priced by %q, want %q", c.Model, got, want)
		}
	}
	for _, c := range v.Usages {
		counts, err := ReadUsage(c.Usage)
		var units *big.Int
		var tokens int64
		if err == nil {
			units, tokens, err = Cost(counts, table, c.Model)
		}
		if c.Malformed {
			if !errors.Is(err, errMalformedUsage) {
				t.Errorf("%s: want malformed, got %v", c.Name, err)
			}
			continue
		}
		if err != nil || units.Int64() != c.Units || tokens != c.Tokens {
			t.Errorf("%s: got %v %d %v, want %d %d", c.Name, units, tokens, err, c.Units, c.Tokens)
		}
	}
	for _, bad := range []ModelPrice{{Input: -1}, {Input: 2e6}, {Output: -0.5}} {
		if _, err := NewPriceTable(map[string]ModelPrice{"m": bad}); err == nil {
			t.Errorf("price %+v accepted", bad)
		}
	}
}

func TestMeteredAnswers(t *testing.T) {
	f := newFakeModel(t)
	for _, c := range []struct {
		path, model string
		cents       int64
	}{{"/v1/chat/completions", "gpt-x", 1}, {"/v1/responses", "gpt-x", 1}, {"/v1/messages", "claude-x", 2}} {
		m, r, client := meterFor(t)
		if body := postText(t, client, f.URL+c.path, map[string]any{"model": c.model}); !strings.Contains(body, "usage") {
			t.Fatalf("%s: %s", c.path, body)
		}
		if r.last() != [2]int64{c.cents, 1500} {
			t.Errorf("%s whole: %v", c.path, r.reports)
		}
		body := postText(t, client, f.URL+c.path, map[string]any{"model": c.model, "stream": true})
		if !strings.Contains(body, "DONE") && !strings.Contains(body, "message_stop") && !strings.Contains(body, "response.completed") {
			t.Errorf("%s stream: %s", c.path, body)
		}
		if r.last()[1] != 3000 || m.Fault() != "" {
			t.Errorf("%s stream: %v %q", c.path, r.reports, m.Fault())
		}
	}
}

func TestStreamedChatIsAskedForUsageAndPassesThroughUnchanged(t *testing.T) {
	f := newFakeModel(t)
	_, r, client := meterFor(t)
	body := map[string]any{"model": "gpt-x", "stream": true, "stream_options": map[string]any{"include_usage": false, "other": 1}}
	metered := postText(t, client, f.URL+"/v1/chat/completions", body)
	f.mu.Lock()
	sent := f.requests[len(f.requests)-1]
	f.mu.Unlock()
	if opts := sent["stream_options"].(map[string]any); opts["include_usage"] != true || opts["other"] != float64(1) {
		t.Fatalf("sent %v", sent)
	}
	if plain := postText(t, http.DefaultClient, f.URL+"/v1/chat/completions", sent); plain != metered {
		t.Errorf("bytes differ:\n%s\n%s", plain, metered)
	}
	if r.last() != [2]int64{1, 1500} {
		t.Errorf("%v", r.reports)
	}
}

func TestAbandonedStreamChargesWhatItSawAndIsUnbuffered(t *testing.T) {
	f := newFakeModel(t)
	hold := make(chan struct{})
	defer close(hold)
	f.next(knobs{hold: hold})
	_, r, client := meterFor(t)
	resp, err := post(t, client, f.URL+"/v1/messages", map[string]any{"model": "claude-x", "stream": true})
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, _ := resp.Body.Read(buf) // arrives while the server holds the rest
	if !strings.Contains(string(buf[:n]), "message_start") {
		t.Fatalf("first read: %q", buf[:n])
	}
	resp.Body.Close()
	if r.last() != [2]int64{1, 1001} {
		t.Errorf("%v", r.reports)
	}
}

func TestGzipAnswers(t *testing.T) {
	f := newFakeModel(t)
	m, r, client := meterFor(t)
	f.next(knobs{gzip: true})
	req, _ := http.NewRequest("POST", f.URL+"/v1/messages", strings.NewReader(`{"model":"claude-x"}`))
	req.Header.Set("Accept-Encoding", "gzip") // set by the caller: the body stays gzip for it
	resp, err := client.Do(req)
	raw := readAll(t, resp, err)
	zr, err := gzip.NewReader(strings.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	plain, _ := io.ReadAll(zr)
	if !strings.Contains(string(plain), "claude-x") || r.last() != [2]int64{2, 1500} {
		t.Errorf("%s %v", plain, r.reports)
	}
	f.next(knobs{gzip: true}) // the default transport asks for gzip and undoes it itself
	postText(t, client, f.URL+"/v1/messages", map[string]any{"model": "claude-x", "stream": true})
	if r.last() != [2]int64{3, 3000} || m.Fault() != "" {
		t.Errorf("%v %q", r.reports, m.Fault())
	}
}

func TestCutStreamsChargeWhatTheySaw(t *testing.T) {
	f := newFakeModel(t)
	for _, c := range []struct {
		path, model string
		cut         int
		want        [2]int64
		faults      bool
	}{{"/v1/messages", "claude-x", 5, [2]int64{2, 1500}, false},
		// message_start's opening count only: charged, and the meter faults (the output went uncounted).
		{"/v1/messages", "claude-x", 4, [2]int64{1, 1001}, true}, {"/v1/messages", "claude-x", 2, [2]int64{1, 1001}, true},
		{"/v1/chat/completions", "gpt-x", 3, [2]int64{}, true}, {"/v1/responses", "gpt-x", 3, [2]int64{}, true}} {
		m, r, client := meterFor(t)
		f.next(knobs{cutAfter: c.cut})
		resp, err := post(t, client, f.URL+c.path, map[string]any{"model": c.model, "stream": true})
		if err == nil {
			io.ReadAll(resp.Body)
			resp.Body.Close()
		}
		// Cut by the server, not abandoned by the caller: a stream that ended without its final usage faults.
		if r.last() != c.want || (m.Fault() != "") != c.faults {
			t.Errorf("%s cut %d: %v %q", c.path, c.cut, r.reports, m.Fault())
		}
	}
}

func TestErrorAnswers(t *testing.T) {
	f := newFakeModel(t)
	m, r, client := meterFor(t)
	f.next(knobs{status: 429, usage: map[string]any{"prompt_tokens": 4000, "completion_tokens": 0}, hasUsage: true})
	postText(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"})
	f.next(knobs{status: 502, body: "<html>bad gateway</html>"})
	if page := postText(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"}); page != "<html>bad gateway</html>" {
		t.Errorf("page %q", page)
	}
	if len(r.reports) != 1 || r.last() != [2]int64{1, 4000} || m.Fault() != "" {
		t.Errorf("%v %q", r.reports, m.Fault())
	}
}

func TestMalformedUsageFaultsAndRefusesLaterRequests(t *testing.T) {
	f := newFakeModel(t)
	for _, u := range []any{map[string]any{"prompt_tokens": -1}, map[string]any{"prompt_tokens": 1e12},
		map[string]any{"prompt_tokens": "9"}, "junk", map[string]any{"prompt_tokens": 1.5},
		map[string]any{"prompt_tokens": 1, "prompt_tokens_details": map[string]any{"cached_tokens": 2}}} {
		m, r, client := meterFor(t)
		f.next(knobs{usage: u, hasUsage: true})
		postText(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"})
		if len(r.reports) != 0 || m.Fault() == "" {
			t.Errorf("%v: %v %q", u, r.reports, m.Fault())
		}
		sent := f.count()
		if _, err := post(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"}); !errors.Is(err, ErrMetering) {
			t.Errorf("%v: later request: %v", u, err)
		}
		if f.count() != sent {
			t.Errorf("%v: a refused request was sent", u)
		}
	}
}

func TestUnpricedModels(t *testing.T) {
	f := newFakeModel(t)
	m, _, client := meterFor(t)
	if _, err := post(t, client, f.URL+"/v1/messages", map[string]any{"model": "nope"}); !errors.Is(err, ErrUnpricedModel) || f.count() != 0 {
		t.Errorf("%v, %d sent", err, f.count())
	}
	if m.Fault() != "" {
		t.Error(m.Fault())
	}
	f.next(knobs{model: "mystery"})
	postText(t, client, f.URL+"/v1/chat/completions", map[string]any{"messages": []any{}})
	if !strings.Contains(m.Fault(), "mystery") {
		t.Errorf("fault %q", m.Fault())
	}
}

func TestConcurrentRequestsLoseNothing(t *testing.T) {
	f := newFakeModel(t)
	m, r, client := meterFor(t)
	if err := m.Add(7, 0); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			path, model := "/v1/chat/completions", "gpt-x"
			if i%2 == 1 {
				path, model = "/v1/messages", "claude-x"
			}
			resp, err := post(t, client, f.URL+path, map[string]any{"model": model, "stream": i%4 < 2})
			if err != nil {
				t.Error(err)
				return
			}
			io.ReadAll(resp.Body)
			resp.Body.Close()
		}()
	}
	wg.Wait()
	// 20 at 0.75 cent, 20 at 1.05 cents, on top of 7: 43 cents
	if r.last() != [2]int64{7 + 36, 40 * 1500} || m.Fault() != "" {
		t.Errorf("%v %q", r.last(), m.Fault())
	}
}

// *Run is a reporter whose Lost, Finished and Signals the meter reads.
var _ interface {
	UsageReporter
	Lost() bool
	Finished() bool
	Signals() Signals
} = (*Run)(nil)

func refusedAfter(t *testing.T, f *fakeModel, client *http.Client, want error) {
	t.Helper()
	sent := f.count()
	if _, err := post(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"}); !errors.Is(err, want) {
		t.Errorf("later request: %v", err)
	}
	if f.count() != sent {
		t.Error("a refused request was sent")
	}
}

func TestAnswersWithoutUsageFault(t *testing.T) {
	f := newFakeModel(t)
	for _, path := range []string{"/v1/chat/completions", "/v1/responses", "/v1/messages"} {
		for _, stream := range []bool{false, true} {
			m, r, client := meterFor(t)
			f.next(knobs{usage: nil, hasUsage: true})
			postText(t, client, f.URL+path, map[string]any{"model": "gpt-x", "stream": stream})
			if len(r.reports) != 0 || !strings.Contains(m.Fault(), "no usage") {
				t.Errorf("%s stream %v: %v %q", path, stream, r.reports, m.Fault())
			}
			refusedAfter(t, f, client, ErrMetering)
		}
	}
	m, _, client := meterFor(t)
	for _, path := range []string{"/v1/audio/speech", "/v1/embeddings"} { // not generation endpoints
		f.next(knobs{body: "\x89PNG"})
		postText(t, client, f.URL+path, map[string]any{"model": "gpt-x"})
	}
	if m.Fault() != "" {
		t.Errorf("fault %q", m.Fault())
	}
	f.next(knobs{body: "\x89PNG"})
	postText(t, client, f.URL+"/v1/completions", map[string]any{"model": "gpt-x"})
	if !strings.Contains(m.Fault(), "no usage") {
		t.Errorf("fault %q", m.Fault())
	}
}

func TestAbandonedOpenAIStreamDoesNotFault(t *testing.T) {
	f := newFakeModel(t)
	m, r, client := meterFor(t)
	hold := make(chan struct{})
	defer close(hold)
	f.next(knobs{hold: hold})
	resp, err := post(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x", "stream": true})
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	resp.Body.Read(buf)
	resp.Body.Close()
	if len(r.reports) != 0 || m.Fault() != "" {
		t.Errorf("%v %q", r.reports, m.Fault())
	}
}

// sseServer answers every request with chunks (the second only once gate is closed, if given).
func sseServer(t *testing.T, ctype string, gate chan struct{}, chunks ...string) *httptest.Server {
	s := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if ctype != "" {
			w.Header().Set("Content-Type", ctype)
		} else {
			w.Header()["Content-Type"] = nil // no content type at all
		}
		w.WriteHeader(200)
		for i, c := range chunks {
			if i == 1 && gate != nil {
				<-gate
			}
			io.WriteString(w, c)
			w.(http.Flusher).Flush()
		}
	}))
	t.Cleanup(s.Close)
	return s
}

const chunkHi = `data: {"model": "gpt-x", "choices": [{"delta": {"content": "hi"}}]}` + "\n\n"

func TestStreamAskedForIsReadAsSSEWhateverItsContentType(t *testing.T) {
	for _, ctype := range []string{"text/plain", ""} {
		m, r, client := meterFor(t)
		gate := make(chan struct{})
		s := sseServer(t, ctype, gate, chunkHi,
			`data: {"model": "gpt-x", "choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 500}}`+"\n\ndata: [DONE]\n\n")
		done := make(chan *http.Response, 1)
		go func() {
			resp, err := post(t, client, s.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x", "stream": true})
			if err != nil {
				done <- nil
				return
			}
			done <- resp
		}()
		var resp *http.Response
		select {
		case resp = <-done:
		case <-time.After(5 * time.Second):
			close(gate)
			t.Fatalf("%q: the answer was buffered", ctype)
		}
		if resp == nil {
			t.Fatal("request failed")
		}
		buf := make([]byte, len(chunkHi))
		if _, err := io.ReadFull(resp.Body, buf); err != nil || string(buf) != chunkHi {
			t.Fatalf("%q: first chunk %q %v", ctype, buf, err)
		}
		close(gate)
		io.ReadAll(resp.Body)
		resp.Body.Close()
		if r.last() != [2]int64{1, 1500} || m.Fault() != "" {
			t.Errorf("%q: %v %q", ctype, r.reports, m.Fault())
		}
	}
}

func TestDoneWithoutUsageFaultsAndGroqUsageIsRead(t *testing.T) {
	m, _, client := meterFor(t)
	s := sseServer(t, "text/event-stream", nil, chunkHi+"data: [DONE]\n\n")
	postText(t, client, s.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x", "stream": true})
	if !strings.Contains(m.Fault(), "no usage") {
		t.Errorf("fault %q", m.Fault())
	}
	m, r, client := meterFor(t)
	s = sseServer(t, "text/event-stream", nil, chunkHi+
		`data: {"model": "gpt-x", "choices": [], "x_groq": {"usage": {"prompt_tokens": 1000, "completion_tokens": 500}}}`+"\n\ndata: [DONE]\n\n")
	postText(t, client, s.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x", "stream": true})
	if r.last() != [2]int64{1, 1500} || m.Fault() != "" {
		t.Errorf("%v %q", r.reports, m.Fault())
	}
}

func TestAnswerNamingAnUnpricedModelFaults(t *testing.T) {
	f := newFakeModel(t)
	r := &reporter{}
	prices := map[string]ModelPrice{"gpt-x-cheap": {}}
	for k, v := range testPrices {
		prices[k] = v
	}
	m, err := NewMeter(r, prices)
	if err != nil {
		t.Fatal(err)
	}
	m.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	f.next(knobs{model: "mystery"})
	postText(t, &http.Client{Transport: m.Transport(nil)}, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x-cheap"})
	if len(r.reports) != 0 || !strings.Contains(m.Fault(), "mystery") {
		t.Errorf("%v %q", r.reports, m.Fault())
	}
}

// runState is a reporter with a run's state.
type runState struct {
	reporter
	mu                   sync.Mutex
	lost, finished, stop bool
}

func (s *runState) Lost() bool     { s.mu.Lock(); defer s.mu.Unlock(); return s.lost }
func (s *runState) Finished() bool { s.mu.Lock(); defer s.mu.Unlock(); return s.finished }
func (s *runState) Signals() Signals {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stop {
		return Signals{Stop: true, Reason: "BudgetExceeded"}
	}
	return Signals{}
}

type failingReporter struct{}

func (failingReporter) ReportUsage(int64, int64) error { return errors.New("run finished") }

func TestRunThatMayNotSpendRefusesRequests(t *testing.T) {
	f := newFakeModel(t)
	for _, end := range []string{"lost", "finished", "stop"} {
		st := &runState{}
		m, err := NewMeter(st, testPrices)
		if err != nil {
			t.Fatal(err)
		}
		client := &http.Client{Transport: m.Transport(nil)}
		postText(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"})
		st.mu.Lock()
		switch end {
		case "lost":
			st.lost = true
		case "finished":
			st.finished = true
		default:
			st.stop = true
		}
		st.mu.Unlock()
		sent := f.count()
		_, err = post(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"})
		if !errors.Is(err, ErrRunStopped) || !errors.Is(err, ErrMetering) || f.count() != sent || m.Fault() != "" {
			t.Errorf("%s: %v, sent %v, fault %q", end, err, f.count() != sent, m.Fault())
		}
		if end == "stop" && !strings.Contains(err.Error(), "BudgetExceeded") {
			t.Errorf("stop: %v", err)
		}
	}
	m, err := NewMeter(failingReporter{}, testPrices)
	if err != nil {
		t.Fatal(err)
	}
	m.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	client := &http.Client{Transport: m.Transport(nil)}
	postText(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"})
	if !strings.Contains(m.Fault(), "run finished") {
		t.Errorf("fault %q", m.Fault())
	}
	refusedAfter(t, f, client, ErrMetering)
}

// --- a cap the attempt's own reports used up; an answer cut by the network --------------------------
//
// A request is refused as soon as the attempt's own reports use up what the control plane said was
// left of the run's cap (the heartbeat woken to tell it at once), and a non-streamed answer cut by
// the network faults the meter as a cut stream does: the `caps` and `cuts` cases of
// sdk/vectors/metering.json, which the Python and TypeScript SDKs run too.

func loadVectors(t *testing.T) vectors {
	t.Helper()
	raw, err := os.ReadFile("../vectors/metering.json")
	if err != nil {
		t.Fatal(err)
	}
	var v vectors
	d := json.NewDecoder(bytes.NewReader(raw))
	d.UseNumber()
	if err := d.Decode(&v); err != nil {
		t.Fatal(err)
	}
	return v
}

// vectorPrices is the vectors' price table as ModelPrices.
func vectorPrices(t *testing.T, v vectors) map[string]ModelPrice {
	t.Helper()
	num := func(x any) float64 {
		f, err := strconv.ParseFloat(fmtAny(x), 64)
		if err != nil {
			t.Fatalf("price %v", x)
		}
		return f
	}
	prices := map[string]ModelPrice{}
	for k, p := range v.Prices {
		mp := ModelPrice{Input: num(p["input"]), Output: num(p["output"])}
		if p["cachedInput"] != nil {
			mp.CachedInput = num(p["cachedInput"])
		}
		if p["cacheWrite"] != nil {
			mp.CacheWrite = num(p["cacheWrite"])
		}
		prices[k] = mp
	}
	return prices
}

func fmtAny(x any) string {
	if n, ok := x.(json.Number); ok {
		return n.String()
	}
	if s, ok := x.(string); ok {
		return s
	}
	return ""
}

// cappedRun is a started Run whose control plane said cents / tokens were left of the run's caps
// when `reported` was reported (the gateway's form; a pod's Lease carries cap and base, the same
// arithmetic). Its heartbeat renews every hour unless woken.
func cappedRun(t *testing.T, cents, tokens *int64, reported [2]int64) (*Run, *fakeTransport) {
	t.Helper()
	own := &usage{Cents: reported[0], Tokens: reported[1]}
	sig := signalsFromRemaining(false, false, nil, cents, tokens, own)
	tr := &fakeTransport{renewFn: func(n int) (renewResult, error) {
		if n == 1 {
			return renewResult{ok: true, signals: &sig}, nil
		}
		return renewResult{ok: true}, nil // no signals: the last ones stand
	}}
	clock := &fakeClock{}
	info := attemptInfo{name: "job", namespace: "ns", holder: "job-a1", fence: 1, attempt: 1,
		leaseDuration: 10 * time.Second, renewInterval: time.Hour}
	r := newRun(context.Background(), info, tr, newSettings([]Option{WithClock(clock.now), WithLogger(discard)}))
	if err := r.ReportUsage(reported[0], reported[1]); err != nil {
		t.Fatal(err)
	}
	r.start(context.Background())
	t.Cleanup(func() { _ = r.Close() })
	return r, tr
}

// capRefused says whether the meter refuses a request now, and checks it says why.
func capRefused(t *testing.T, m *Meter) bool {
	t.Helper()
	err := m.check("gpt-x")
	if err != nil && (!errors.Is(err, ErrRunStopped) || !strings.Contains(err.Error(), "cap is used up")) {
		t.Fatalf("refused, but not for the cap: %v", err)
	}
	return err != nil
}

// renewedTo waits (up to 5 s) for the transport to have had n renewals; a shorter wait when none
// more is expected.
func renewedTo(tr *fakeTransport, n int, expect bool) int {
	wait := 100 * time.Millisecond
	if expect {
		wait = 5 * time.Second
	}
	deadline := time.Now().Add(wait)
	for time.Now().Before(deadline) && tr.renewCount() < n {
		time.Sleep(5 * time.Millisecond)
	}
	if !expect {
		time.Sleep(50 * time.Millisecond)
	}
	return tr.renewCount()
}

func TestCapVectors(t *testing.T) {
	v := loadVectors(t)
	if len(v.Caps) == 0 {
		t.Fatal("no cap cases")
	}
	for _, c := range v.Caps {
		t.Run(c.Name, func(t *testing.T) {
			r, tr := cappedRun(t, c.CapRemainingCents, c.CapRemainingTokens, c.Reported)
			m, err := NewMeter(r, testPrices)
			if err != nil {
				t.Fatal(err)
			}
			m.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
			if err := m.Add(c.Reported[0], c.Reported[1]); err != nil { // its base: reported already
				t.Fatal(err)
			}
			if got := capRefused(t, m); got != c.RefusedAtStart {
				t.Fatalf("refused at start: %v", got)
			}
			for i, step := range c.Steps {
				before := tr.renewCount()
				if err := m.Add(step.Add[0], step.Add[1]); err != nil {
					t.Fatal(err)
				}
				want := before
				if step.Wakes {
					want++
				}
				refused, renewals := capRefused(t, m), renewedTo(tr, want, step.Wakes)
				if refused != step.Refused || renewals != want {
					t.Fatalf("step %d: refused %v (want %v), %d renewals (want %d)", i, refused, step.Refused, renewals, want)
				}
				if step.Wakes {
					if u := tr.lastRenew().usage; u == nil || *u != (usage{Cents: m.Cents(), Tokens: m.Tokens()}) {
						t.Errorf("step %d: the renewal carried %v", i, u)
					}
				}
			}
			if m.Fault() != "" {
				t.Errorf("fault %q", m.Fault())
			}
		})
	}
}

func TestAnAnswerThatUsesUpTheCapRefusesTheNextRequestAtOnce(t *testing.T) {
	f := newFakeModel(t)
	r, tr := cappedRun(t, ptr[int64](1), nil, [2]int64{})
	m, err := NewMeter(r, testPrices)
	if err != nil {
		t.Fatal(err)
	}
	client := &http.Client{Transport: m.Transport(nil)}
	// 1000 prompt at 2.5 + 500 completion at 10 = 0.75 cent, reported as 1: all that was left.
	postText(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"})
	sent := f.count()
	_, err = post(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"})
	if !errors.Is(err, ErrRunStopped) || !strings.Contains(err.Error(), "cap is used up") || f.count() != sent {
		t.Fatalf("the request after the cap: %v (sent: %v)", err, f.count() != sent)
	}
	if left := r.Signals().CapRemainingCents; left == nil || *left != 0 {
		t.Errorf("cap remaining %v", left)
	}
	if n := renewedTo(tr, 2, true); n != 2 || *tr.lastRenew().usage != (usage{Cents: 1, Tokens: 1500}) {
		t.Errorf("%d renewals, the last carrying %v", n, tr.lastRenew().usage)
	}
	if m.Fault() != "" {
		t.Errorf("fault %q", m.Fault())
	}
}

// cutModel answers every request with the case's status, content type and the first CutAt bytes
// of its body; reading on fails as a dropped connection does.
type cutModel struct {
	c    cutCase
	sent int
}

type cutReader struct{}

func (cutReader) Read([]byte) (int, error) { return 0, io.ErrUnexpectedEOF }

func (m *cutModel) RoundTrip(req *http.Request) (*http.Response, error) {
	m.sent++
	head := []byte(m.c.Body)[:m.c.CutAt]
	return &http.Response{StatusCode: m.c.Status, Header: http.Header{"Content-Type": {m.c.ContentType}},
		Body: io.NopCloser(io.MultiReader(bytes.NewReader(head), cutReader{})), Request: req}, nil
}

func TestCutVectors(t *testing.T) {
	v := loadVectors(t)
	if len(v.Cuts) == 0 {
		t.Fatal("no cut cases")
	}
	prices := vectorPrices(t, v)
	for _, c := range v.Cuts {
		t.Run(c.Name, func(t *testing.T) {
			r := &reporter{}
			m, err := NewMeter(r, prices)
			if err != nil {
				t.Fatal(err)
			}
			m.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
			inner := &cutModel{c: c}
			client := &http.Client{Transport: m.Transport(inner)}
			url := "http://model.test" + c.Path
			resp, err := post(t, client, url, c.Request)
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				resp.Body.Close()
			}
			if !errors.Is(err, io.ErrUnexpectedEOF) {
				t.Fatalf("reading the answer: %v", err)
			}
			if (m.Fault() != "") != c.Faults {
				t.Fatalf("fault %q, want a fault: %v", m.Fault(), c.Faults)
			}
			if c.Faults {
				if !strings.Contains(m.Fault(), "cut") {
					t.Errorf("fault %q", m.Fault())
				}
				if _, err := post(t, client, url, c.Request); !errors.Is(err, ErrMetering) || inner.sent != 1 {
					t.Errorf("the retry: %v, sent %d", err, inner.sent)
				}
			}
			if r.last() != c.Charged {
				t.Errorf("charged %v, want %v", r.last(), c.Charged)
			}
		})
	}
}

func TestAWholeAnswerCutByTheNetworkFaultsTheMeter(t *testing.T) {
	f := newFakeModel(t)
	m, _, client := meterFor(t)
	f.next(knobs{cutBody: 40})
	if _, err := post(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"}); err == nil || errors.Is(err, ErrMetering) {
		t.Fatalf("the cut answer: %v", err)
	}
	if !strings.Contains(m.Fault(), "cut") {
		t.Fatalf("fault %q", m.Fault())
	}
	sent := f.count()
	if _, err := post(t, client, f.URL+"/v1/chat/completions", map[string]any{"model": "gpt-x"}); !errors.Is(err, ErrMetering) ||
		errors.Is(err, ErrRunStopped) || f.count() != sent {
		t.Errorf("the retry: %v, sent %v", err, f.count() != sent)
	}
}
