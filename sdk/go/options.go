package tether

import (
	"log/slog"
	"net/http"
	"time"
)

// Option configures FromEnv or Claim. An option that concerns only one of them (WithWorkerID,
// WithHTTPClient: Claim) is ignored by the other.
type Option func(*settings)

type settings struct {
	workerID     string
	httpClient   *http.Client // the gateway's
	effectClient *http.Client
	clock        Clock
	logger       *slog.Logger
}

func newSettings(opts []Option) settings {
	s := settings{
		httpClient:   &http.Client{Timeout: 30 * time.Second},
		effectClient: &http.Client{Timeout: 30 * time.Second},
		clock:        monotonic,
		logger:       slog.Default(),
	}
	for _, opt := range opts {
		opt(&s)
	}
	return s
}

// WithWorkerID names this process when claiming (Claim): the gateway then accepts later calls for
// the attempt only from the same identity naming the same worker.
func WithWorkerID(id string) Option { return func(s *settings) { s.workerID = id } }

// WithHTTPClient is the client for the gateway's calls (Claim); its transport may carry TLS
// settings. Every call still gets the protocol's request timeout from its context.
func WithHTTPClient(c *http.Client) Option { return func(s *settings) { s.httpClient = c } }

// WithEffectClient is the client Effect sends side effects with (default: a 30 s timeout).
func WithEffectClient(c *http.Client) Option { return func(s *settings) { s.effectClient = c } }

// WithClock replaces the monotonic clock ownership deadlines are measured on (tests).
func WithClock(c Clock) Option { return func(s *settings) { s.clock = c } }

// WithLogger is where the SDK logs its events (default slog.Default()).
func WithLogger(l *slog.Logger) Option { return func(s *settings) { s.logger = l } }
