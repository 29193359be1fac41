package tether

// Usage metered from the model's own answers: an http.RoundTripper that reads the `usage` of every
// OpenAI-compatible or Anthropic-style answer (streamed or not), prices it from a table you pass,
// and reports the attempt's cumulative cents and tokens with Run.ReportUsage on the heartbeat.
//
//	meter, err := tether.NewMeter(run, map[string]tether.ModelPrice{"gpt-4o-mini": {Input: 0.15, Output: 0.6, CachedInput: 0.075}})
//	client := &http.Client{Transport: meter.Transport(nil)}   // e.g. option.WithHTTPClient(client)
//
// Prices are USD per million tokens. The rules (rounding, unknown models, streams without usage,
// answers that cannot be read) are in docs/budgets.md, "Metering model spend"; the pricing and
// parsing cases every SDK passes are in sdk/vectors/metering.json.

import (
	"bytes"
	"compress/flate"
	"compress/gzip"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
)

// UsageReporter is what a Meter reports to: *Run. Optionally (*Run has them all), what says
// whether the run may still spend: Lost() (the lease is lost), Finished() (a result or an error
// was published), Signals().Stop (the control plane told the worker to stop) and
// Signals().CapRemainingCents / CapRemainingTokens (what the control plane last said was left of
// the run's caps, less what was reported since). The meter refuses to send a request while any is
// true or a cap is used up (0 or less left) (ErrRunStopped); a reporter without them is taken to
// be working.
type UsageReporter interface {
	ReportUsage(cents, tokens int64) error
}

// RunRefusal says why the run behind reporter may not spend any more (its lease lost, its result
// or error published, told to stop, its cap used up by its own reports), or "". Ownership merely
// unknown (a renewal not answered yet) is not a reason: a brief API blip must not break model calls.
func RunRefusal(reporter UsageReporter) string {
	if r, ok := reporter.(interface{ Lost() bool }); ok && r.Lost() {
		return "the run's lease is lost"
	}
	if r, ok := reporter.(interface{ Finished() bool }); ok && r.Finished() {
		return "the run has finished (its result or error is published)"
	}
	if r, ok := reporter.(interface{ Signals() Signals }); ok {
		if s := r.Signals(); s.Stop {
			if s.Reason != "" {
				return "the control plane asked this worker to stop (" + s.Reason + ")"
			}
			return "the control plane asked this worker to stop"
		} else if why := capUsedUp(s.CapRemainingCents, s.CapRemainingTokens); why != "" {
			// The run's own arithmetic (cap - base - own reports), not a copy of it: spending is
			// refused as soon as the meter's own report reaches the cap, not a heartbeat or two later.
			return why
		}
	}
	return ""
}

// generation: a 2xx answer to a request naming a model on one of these paths carries usage.
var generation = []string{"/completions", "/responses", "/messages"}

// ModelPrice is one model's prices in USD per million tokens. CachedInput (a prompt-cache read)
// defaults to Input when zero; CacheWrite (an Anthropic cache write) to twice Input when zero.
type ModelPrice struct {
	Input, Output, CachedInput, CacheWrite float64
}

var (
	// ErrMetering: the meter will not send the request (an earlier answer could not be metered).
	ErrMetering = errors.New("tether: request refused by the meter")
	// ErrUnpricedModel: the request names a model the price table has no price for.
	ErrUnpricedModel = fmt.Errorf("%w: no price for the model", ErrMetering)
	// ErrRunStopped: the run may not spend any more (its lease lost, its result or error
	// published, told to stop, or its cap used up by the attempt's own reports); the meter is not
	// faulted.
	ErrRunStopped     = fmt.Errorf("%w: the run may not spend any more", ErrMetering)
	errMalformedUsage = errors.New("malformed usage")
)

const (
	maxPrice           = 1_000_000 // USD per million tokens
	MaxTokensPerAnswer = 1_000_000_000
	maxReadAhead       = 64 << 20
	maxEvent           = 16 << 20
)

// UnitsPerCent: money is counted in 1e-12 USD; P USD per million tokens is P*1e6 units a token.
var UnitsPerCent = big.NewInt(10_000_000_000)

var dateSuffix = regexp.MustCompile(`^(.+)-(\d{4}-\d{2}-\d{2}|\d{8})$`)

var usageFields = []string{"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details.cached_tokens",
	"input_tokens", "output_tokens", "input_tokens_details.cached_tokens",
	"cache_read_input_tokens", "cache_creation_input_tokens"}

type price struct{ input, output, cachedInput, cacheWrite int64 } // micro-USD per million tokens

// MicroPrice converts USD per million tokens to micro-USD per million tokens, rounded up past the
// sixth decimal (the shortest decimal that reads back as the float, so 0.15 is 150000).
func MicroPrice(v float64) (int64, error) {
	if v != v || v < 0 || v > maxPrice {
		return 0, fmt.Errorf("a price is 0 to %d USD per million tokens, not %v", maxPrice, v)
	}
	r, _ := new(big.Rat).SetString(strconv.FormatFloat(v, 'f', -1, 64))
	r.Mul(r, big.NewRat(1_000_000, 1))
	q, m := new(big.Int).QuoRem(r.Num(), r.Denom(), new(big.Int))
	if m.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	return q.Int64(), nil
}

// PriceTable prices a model by its exact name; else by the name with a date suffix removed
// (-2024-08-06, -20241022); else by the longest key ending in "*" it starts with.
type PriceTable struct {
	prices   map[string]price
	prefixes []string
}

// NewPriceTable checks every price.
func NewPriceTable(prices map[string]ModelPrice) (*PriceTable, error) {
	if len(prices) == 0 {
		return nil, errors.New("price table: no models")
	}
	t := &PriceTable{prices: map[string]price{}}
	for k, v := range prices {
		var p price
		var err error
		for _, f := range []struct {
			dst *int64
			v   float64
		}{{&p.input, v.Input}, {&p.output, v.Output}, {&p.cachedInput, v.CachedInput}, {&p.cacheWrite, v.CacheWrite}} {
			if *f.dst, err = MicroPrice(f.v); err != nil {
				return nil, fmt.Errorf("price of %q: %w", k, err)
			}
		}
		if v.CachedInput == 0 {
			p.cachedInput = p.input
		}
		if v.CacheWrite == 0 {
			p.cacheWrite = 2 * p.input
		}
		t.prices[k] = p
		if strings.HasSuffix(k, "*") {
			t.prefixes = append(t.prefixes, k)
		}
	}
	sort.Slice(t.prefixes, func(i, j int) bool { return len(t.prefixes[i]) > len(t.prefixes[j]) })
	return t, nil
}

// Key is the table entry that prices model, or "" (unpriced).
func (t *PriceTable) Key(model string) string {
	if model == "" {
		return ""
	}
	if _, ok := t.prices[model]; ok && !strings.HasSuffix(model, "*") {
		return model
	}
	if m := dateSuffix.FindStringSubmatch(model); m != nil {
		if _, ok := t.prices[m[1]]; ok && !strings.HasSuffix(m[1], "*") {
			return m[1]
		}
	}
	for _, k := range t.prefixes {
		if strings.HasPrefix(model, k[:len(k)-1]) {
			return k
		}
	}
	return ""
}

func (t *PriceTable) lookup(model string) (price, bool) {
	k := t.Key(model)
	p, ok := t.prices[k]
	return p, ok && k != ""
}

// ReadUsage returns the counts a meter prices from one usage block (nested details flattened with
// a dot); null counts are absent. Anything else that is not a count is malformed.
func ReadUsage(usage any) (map[string]int64, error) {
	u, ok := usage.(map[string]any)
	if !ok {
		return nil, fmt.Errorf("%w: usage is not an object", errMalformedUsage)
	}
	out := map[string]int64{}
	for _, field := range usageFields {
		head, tail, nested := strings.Cut(field, ".")
		v := u[head]
		if nested {
			if v == nil {
				continue
			}
			inner, ok := v.(map[string]any)
			if !ok {
				return nil, fmt.Errorf("%w: usage.%s is not an object", errMalformedUsage, head)
			}
			v = inner[tail]
		}
		if v == nil {
			continue
		}
		num, ok := v.(json.Number)
		n, err := num.Int64()
		if !ok || err != nil || n < 0 || n > MaxTokensPerAnswer {
			return nil, fmt.Errorf("%w: usage.%s is not a count of 0 to %d: %.40v", errMalformedUsage, field, MaxTokensPerAnswer, v)
		}
		out[field] = n
	}
	return out, nil
}

// Cost is one answer's units (1e-12 USD) and tokens. OpenAI's prompt/input tokens include the
// cached ones; Anthropic's input_tokens exclude cache reads and writes.
func Cost(counts map[string]int64, t *PriceTable, model string) (*big.Int, int64, error) {
	p, ok := t.lookup(model)
	if !ok {
		return nil, 0, fmt.Errorf("%w: no price for model %q", errMalformedUsage, model)
	}
	return cost(counts, p)
}

func has(m map[string]int64, k string) bool { _, ok := m[k]; return ok }

func cost(c map[string]int64, p price) (*big.Int, int64, error) {
	var in, cached, written, out int64
	switch {
	case has(c, "prompt_tokens") || has(c, "completion_tokens"):
		in, cached, out = c["prompt_tokens"], c["prompt_tokens_details.cached_tokens"], c["completion_tokens"]
	case has(c, "input_tokens_details.cached_tokens") || has(c, "total_tokens"):
		in, cached, out = c["input_tokens"], c["input_tokens_details.cached_tokens"], c["output_tokens"]
	default:
		cached, written, out = c["cache_read_input_tokens"], c["cache_creation_input_tokens"], c["output_tokens"]
		in = c["input_tokens"] + cached + written
	}
	if cached+written > in {
		return nil, 0, fmt.Errorf("%w: %d cached input tokens of %d", errMalformedUsage, cached+written, in)
	}
	units := new(big.Int)
	for _, t := range [][2]int64{{in - cached - written, p.input}, {cached, p.cachedInput}, {written, p.cacheWrite}, {out, p.output}} {
		units.Add(units, new(big.Int).Mul(big.NewInt(t[0]), big.NewInt(t[1])))
	}
	return units, in + out, nil
}

func ceilCents(units *big.Int) int64 {
	q, m := new(big.Int).QuoRem(units, UnitsPerCent, new(big.Int))
	if m.Sign() > 0 {
		q.Add(q, big.NewInt(1))
	}
	return q.Int64()
}

// Meter is the attempt's metered spend, reported cumulatively through ReportUsage. It is the
// single source of the attempt's usage reports: report other spending with Add, never with
// ReportUsage directly (a report lower than the meter's would be refused). One meter per run;
// its transports may be used by any number of goroutines.
type Meter struct {
	Prices   *PriceTable
	reporter UsageReporter
	mu       sync.Mutex // arithmetic and one in-memory report; never held across I/O
	units    *big.Int
	tokens   int64
	reported [2]int64
	fault    string
	// Log receives an answer that could not be metered (default slog.Default()).
	Log *slog.Logger
}

// NewMeter makes a meter. Usage reported before it existed: Add it first.
func NewMeter(reporter UsageReporter, prices map[string]ModelPrice) (*Meter, error) {
	t, err := NewPriceTable(prices)
	if err != nil {
		return nil, err
	}
	return &Meter{Prices: t, reporter: reporter, units: new(big.Int)}, nil
}

// Cents is the metered total, rounded up; Tokens likewise.
func (m *Meter) Cents() int64 { m.mu.Lock(); defer m.mu.Unlock(); return ceilCents(m.units) }

// Tokens is the metered total of tokens.
func (m *Meter) Tokens() int64 { m.mu.Lock(); defer m.mu.Unlock(); return m.tokens }

// Fault says why the meter refuses new requests (an answer it could not meter), or "".
func (m *Meter) Fault() string { m.mu.Lock(); defer m.mu.Unlock(); return m.fault }

// Add adds spending the meter does not see (a tool's bill, usage reported before the meter).
func (m *Meter) Add(cents, tokens int64) error {
	if cents < 0 || tokens < 0 {
		return fmt.Errorf("%w: negative usage added", ErrUsageRefused)
	}
	m.charge(new(big.Int).Mul(big.NewInt(cents), UnitsPerCent), tokens)
	return nil
}

func (m *Meter) charge(units *big.Int, tokens int64) {
	if units.Sign() <= 0 && tokens <= 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.units.Add(m.units, units)
	m.tokens += tokens
	report := [2]int64{ceilCents(m.units), m.tokens}
	if report == m.reported {
		return
	}
	// Under the lock: two answers ending together report in order, never lower.
	if err := m.reporter.ReportUsage(report[0], report[1]); err != nil {
		m.tripLocked("usage report refused: " + err.Error())
		return
	}
	m.reported = report
}

func (m *Meter) trip(why string) { m.mu.Lock(); defer m.mu.Unlock(); m.tripLocked(why) }

func (m *Meter) tripLocked(why string) {
	if m.fault == "" {
		m.fault = why
	}
	log := m.Log
	if log == nil {
		log = slog.Default()
	}
	log.Error("model answer not metered; later requests are refused", "event", "metering_fault", "reason", why)
}

func (m *Meter) check(model string) error {
	if f := m.Fault(); f != "" {
		return fmt.Errorf("%w: an earlier answer could not be metered (%s)", ErrMetering, f)
	}
	if why := RunRefusal(m.reporter); why != "" {
		return fmt.Errorf("%w: %s", ErrRunStopped, why)
	}
	if model != "" && m.Prices.Key(model) == "" {
		return fmt.Errorf("%w: %q is not in the price table", ErrUnpricedModel, model)
	}
	return nil
}

// answer is one answer's usage as seen so far; it charges what is new each time usage appears.
type answer struct {
	meter               *Meter
	requestModel, model string
	counts              map[string]int64
	units               *big.Int
	tokens              int64
	expectUsage         bool // a 2xx answer to a generation request naming a model
	seen, closed        bool
	// final: a usage block that is the answer's final count was read, not only Anthropic's opening
	// count in message_start (output_tokens 1), which message_delta completes.
	final bool
}

// checkEnded: the answer ended (read whole, or a stream at its end or its [DONE]), or reading it
// failed (cut: the server or the network cut it, streamed or read ahead whole); one that should
// have carried usage and carried none faults the meter -- never silently free.
func (a *answer) checkEnded(cut error) {
	if a.closed {
		return
	}
	a.closed = true
	if a.expectUsage && !a.final && a.meter.Fault() == "" {
		if a.seen { // a stream that ended after its opening count: the rest of it went uncounted
			how, why := "ended", ""
			if cut != nil {
				how, why = "was cut", fmt.Sprintf(" (%.200s)", cut)
			}
			a.meter.trip(fmt.Sprintf("a streamed answer to a %q request %s before its final usage (only its opening count was read)%s",
				a.requestModel, how, why))
			return
		}
		if cut != nil {
			a.meter.trip(fmt.Sprintf("a 2xx answer to a %q request was cut before its usage was read (%.200s)", a.requestModel, cut))
		} else {
			a.meter.trip(fmt.Sprintf("a 2xx answer to a %q request carried no usage", a.requestModel))
		}
	}
}

func (a *answer) see(usage any, model any, final bool) {
	if s, ok := model.(string); ok && s != "" && a.model == "" {
		a.model = s
	}
	if usage == nil {
		return
	}
	counts, err := ReadUsage(usage)
	if err != nil {
		a.meter.trip(err.Error())
		return
	}
	if len(counts) == 0 {
		return
	}
	a.seen = true
	a.final = a.final || final
	merged := map[string]int64{}
	for k, v := range a.counts {
		merged[k] = v
	}
	for k, v := range counts { // streams repeat or grow their counts: keep the largest
		merged[k] = max(merged[k], v)
	}
	// Priced by the model that answered (a router or alias may answer with another); by the
	// request's only when the answer names none. Unpriced: fail closed.
	named := a.model
	if named == "" {
		named = a.requestModel
	}
	p, ok := a.meter.Prices.lookup(named)
	if !ok {
		a.meter.trip(fmt.Sprintf("no price for the answer's model %q (asked for %q)", a.model, a.requestModel))
		return
	}
	units, tokens, err := cost(merged, p)
	if err != nil {
		a.meter.trip(err.Error())
		return
	}
	a.counts = merged
	du := new(big.Int).Sub(units, a.units)
	if du.Sign() < 0 {
		du.SetInt64(0)
	}
	dt := max(0, tokens-a.tokens)
	a.units.Add(a.units, du)
	a.tokens += dt
	a.meter.charge(du, dt)
}

// seeObject: usage at the top (chat, message_delta, a whole answer), under "response" (responses
// API events), "message" (message_start) or "x_groq" (Groq's streams).
func (a *answer) seeObject(obj any) {
	o, ok := obj.(map[string]any)
	if !ok {
		return
	}
	a.see(o["usage"], o["model"], true)
	for _, k := range []string{"response", "message", "x_groq"} {
		if inner, ok := o[k].(map[string]any); ok {
			a.see(inner["usage"], inner["model"], k != "message")
		}
	}
}

func decodeJSON(data []byte) (any, error) {
	d := json.NewDecoder(bytes.NewReader(data))
	d.UseNumber()
	var v any
	if err := d.Decode(&v); err != nil {
		return nil, err
	}
	if d.More() {
		return nil, errors.New("trailing data")
	}
	return v, nil
}

// events reads SSE incrementally; each complete event's data goes to the answer.
type events struct {
	a        *answer
	buf      []byte
	data     [][]byte
	size     int
	overflow bool
}

func (e *events) feed(p []byte) {
	e.buf = append(e.buf, p...)
	for {
		i := bytes.IndexAny(e.buf, "\r\n")
		if i < 0 || (e.buf[i] == '\r' && i+1 == len(e.buf)) {
			break // a \r at the end may be half of \r\n
		}
		line := e.buf[:i]
		skip := 1
		if e.buf[i] == '\r' && e.buf[i+1] == '\n' {
			skip = 2
		}
		e.line(append([]byte(nil), line...))
		e.buf = e.buf[i+skip:]
	}
	if len(e.buf)+e.size > maxEvent {
		e.overflow, e.buf, e.data, e.size = true, nil, nil, 0
	}
}

func (e *events) line(line []byte) {
	if len(line) == 0 {
		e.dispatch()
	} else if v, ok := bytes.CutPrefix(line, []byte("data:")); ok {
		v, _ = bytes.CutPrefix(v, []byte(" "))
		e.data = append(e.data, v)
		e.size += len(v)
	}
}

func (e *events) dispatch() {
	data := bytes.Join(e.data, []byte("\n"))
	e.data, e.size = nil, 0
	if e.overflow {
		e.overflow = false
		e.a.meter.trip(fmt.Sprintf("a streamed event over %d bytes", maxEvent))
		return
	}
	if string(bytes.TrimSpace(data)) == "[DONE]" {
		e.a.checkEnded(nil) // OpenAI's usage chunk comes before [DONE]
		return
	}
	if len(data) == 0 {
		return
	}
	obj, err := decodeJSON(data)
	if err != nil {
		return // not JSON: no usage in it
	}
	e.a.seeObject(obj)
}

// end: the stream ended (completed: at its end, or cut by the server or the network) or the caller
// abandoned it (Close before EOF); a last complete but unterminated event still counts. Only a
// stream the caller did not abandon must have had usage.
func (e *events) end(completed bool, cut error) {
	if len(e.buf) > 0 {
		e.line(e.buf)
		e.buf = nil
	}
	if len(e.data) > 0 {
		e.dispatch()
	}
	if completed {
		e.a.checkEnded(cut)
	}
}

// meteredBody hands the caller every byte as it comes and reads the events on the way.
type meteredBody struct {
	rc    io.ReadCloser
	mu    sync.Mutex
	ev    *events
	ended bool
}

func (b *meteredBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	b.mu.Lock()
	defer b.mu.Unlock()
	if n > 0 && !b.ended {
		b.ev.feed(p[:n])
	}
	if err == io.EOF {
		b.endLocked(true, nil)
	} else if err != nil {
		b.endLocked(true, err) // cut: what the stream said so far is charged already; none at all faults
	}
	return n, err
}

func (b *meteredBody) endLocked(completed bool, cut error) {
	if !b.ended {
		b.ended = true
		b.ev.end(completed, cut)
	}
}

func (b *meteredBody) Close() error {
	err := b.rc.Close()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.endLocked(false, nil) // abandoned halfway by the caller: charges what it saw
	return err
}

type meteredTransport struct {
	m     *Meter
	inner http.RoundTripper
}

// Transport is an http.RoundTripper metering every answer; inner nil is http.DefaultTransport.
func (m *Meter) Transport(inner http.RoundTripper) http.RoundTripper {
	if inner == nil {
		inner = http.DefaultTransport
	}
	return &meteredTransport{m: m, inner: inner}
}

func (t *meteredTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	var body []byte
	if req.Body != nil && req.Body != http.NoBody {
		var err error
		body, err = io.ReadAll(req.Body)
		req.Body.Close()
		if err != nil {
			return nil, err
		}
	}
	var doc map[string]any
	model := ""
	if d, err := decodeJSON(body); err == nil {
		doc, _ = d.(map[string]any)
		model, _ = doc["model"].(string)
	}
	if err := t.m.check(model); err != nil {
		return nil, err
	}
	out := req.Clone(req.Context())
	path := strings.TrimRight(req.URL.Path, "/")
	streamed := doc != nil && doc["stream"] == true
	isGeneration := false
	for _, g := range generation {
		isGeneration = isGeneration || (model != "" && strings.HasSuffix(path, g))
	}
	if streamed && strings.HasSuffix(path, "/completions") {
		opts, _ := doc["stream_options"].(map[string]any)
		if opts == nil {
			opts = map[string]any{}
		}
		if opts["include_usage"] != true {
			// OpenAI sends a streamed answer's usage only when asked: the meter always asks.
			opts["include_usage"] = true
			doc["stream_options"] = opts
			if b, err := json.Marshal(doc); err == nil {
				body = b
			}
		}
	}
	if req.Body != nil && req.Body != http.NoBody {
		out.Body = io.NopCloser(bytes.NewReader(body))
		out.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
		out.ContentLength = int64(len(body))
		out.Header.Del("Content-Length")
	}
	resp, err := t.inner.RoundTrip(out)
	if err != nil {
		return nil, err
	}
	ok := resp.StatusCode >= 200 && resp.StatusCode < 300
	a := &answer{meter: t.m, requestModel: model, units: new(big.Int), expectUsage: isGeneration && ok}
	ctype := strings.ToLower(resp.Header.Get("Content-Type"))
	enc := strings.ToLower(strings.TrimSpace(resp.Header.Get("Content-Encoding")))
	if resp.Uncompressed {
		enc = ""
	}
	// A stream is what the request asked for: a 2xx non-JSON answer to it is read as SSE, whatever
	// its content type says (text/plain, none), and never buffered.
	if strings.Contains(ctype, "text/event-stream") || (streamed && ok && !strings.Contains(ctype, "json")) {
		if enc != "" && enc != "identity" {
			t.m.trip("a stream in an encoding the meter does not read: " + enc)
			return resp, nil
		}
		resp.Body = &meteredBody{rc: resp.Body, ev: &events{a: a}}
		return resp, nil
	}
	if !strings.Contains(ctype, "json") && model == "" {
		return resp, nil
	}
	raw, err := io.ReadAll(io.LimitReader(resp.Body, maxReadAhead+1))
	if err != nil {
		a.checkEnded(err) // cut: the model answered (and billed), and the body never arrived whole
		resp.Body.Close()
		return nil, err
	}
	if len(raw) > maxReadAhead {
		t.m.trip(fmt.Sprintf("an answer over %d bytes was not read for usage", maxReadAhead))
		resp.Body = struct {
			io.Reader
			io.Closer
		}{io.MultiReader(bytes.NewReader(raw), resp.Body), resp.Body}
		return resp, nil
	}
	resp.Body.Close()
	resp.Body = io.NopCloser(bytes.NewReader(raw))
	text, derr := decoded(raw, enc)
	if derr != nil {
		if ok {
			t.m.trip(derr.Error())
		}
		return resp, nil
	}
	obj, jerr := decodeJSON(text)
	if jerr != nil {
		if ok && strings.Contains(ctype, "json") {
			t.m.trip(fmt.Sprintf("a %d JSON answer that is not JSON", resp.StatusCode))
		}
		a.checkEnded(nil)
		return resp, nil
	}
	a.seeObject(obj) // any status: a usage block in an error answer is charged
	a.checkEnded(nil)
	return resp, nil
}

// decoded undoes a Content-Encoding for the meter's own reading; the caller gets the raw bytes.
func decoded(raw []byte, enc string) ([]byte, error) {
	switch enc {
	case "", "identity":
		return raw, nil
	case "gzip", "x-gzip":
		r, err := gzip.NewReader(bytes.NewReader(raw))
		if err != nil {
			return nil, fmt.Errorf("an answer that does not decode: %w", err)
		}
		return io.ReadAll(r)
	case "deflate":
		if len(raw) > 1 && raw[0]&0x0f == 8 && (int(raw[0])<<8|int(raw[1]))%31 == 0 {
			raw = raw[2:] // zlib-wrapped: skip its header (flate stops at the end of the stream)
		}
		return io.ReadAll(flate.NewReader(bytes.NewReader(raw)))
	}
	return nil, fmt.Errorf("an answer in an encoding the meter cannot read (%s)", enc)
}
