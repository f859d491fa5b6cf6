package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/infermesh/infermesh/agent/admin"
)

// `infermesh top`: a live view of this node's traffic, refreshed every
// interval, from the agent's metrics (topframe.go computes each frame).

func init() {
	register(newTopCmd)
}

func newTopCmd(a *app) *cobra.Command {
	var once bool
	var interval time.Duration
	cmd := &cobra.Command{
		Use:   "top",
		Short: "Live view per role: requests/s, TTFT p50/p90, tokens/s, errors, streams, and the share each node served",
		Long: `top shows, per role and refreshed every --interval (1s), what this node's
apps asked of it over the last interval: requests per second, errors per
second (answers other than 2xx), time to first token (p50 and p90 of the
streams started), completion tokens per second, the streams in flight now,
the requests per second this node served for its peers, and the share of the
apps' requests each target served (local, a peer, or none when nobody could).

In a terminal it takes the whole screen; q or Ctrl-C quits. --once prints one
frame, measured over one interval, and exits (for scripts; --json gives the
rows as JSON).`,
		Args: noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if interval < 100*time.Millisecond {
				return &usageError{msg: fmt.Sprintf("--interval %v: at least 100ms", interval)}
			}
			return runTop(cmd.Context(), a, interval, once)
		},
	}
	cmd.Flags().BoolVar(&once, "once", false, "print one frame and exit")
	cmd.Flags().DurationVar(&interval, "interval", time.Second, "time between frames (and the window rates are measured over)")
	return cmd
}

// topFrame is one frame as --json prints it.
type topFrame struct {
	Node            string   `json:"node"`
	At              string   `json:"at"`
	IntervalSeconds float64  `json:"interval_seconds"`
	Roles           []topRow `json:"roles"`
}

func runTop(ctx context.Context, a *app, interval time.Duration, once bool) error {
	c := a.client()
	defer c.Close()
	scrape := func() (topSample, error) {
		text, err := c.Metrics(ctx)
		if err != nil {
			return topSample{}, err
		}
		return parseTopSample(text, time.Now())
	}
	prev, err := scrape()
	if err != nil {
		return err
	}
	screen := newTopScreen(a.out, once || a.json)
	if screen.raw {
		ctx = screen.start(ctx)
		defer screen.stop()
	}
	show := func(st admin.Status, cur topSample) error {
		rows := topRows(prev, cur)
		prev = cur
		if a.json {
			return a.print(topFrame{Node: st.Node, At: cur.at.UTC().Format(time.RFC3339Nano), IntervalSeconds: interval.Seconds(), Roles: rows}, "")
		}
		return screen.frame(renderTop(st, rows, interval, cur.at))
	}
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		cur, err := scrape()
		if err == nil {
			var st admin.Status
			if st, err = c.Status(ctx); err == nil {
				err = show(st, cur)
			}
		}
		if ctx.Err() != nil {
			return nil // quit (q, Ctrl-C) while a frame was fetched
		}
		if err != nil {
			return err
		}
		if once {
			return nil
		}
	}
}

// topScreen draws frames: on a terminal, in the alternate screen with the
// terminal in raw mode (so q quits without Enter); elsewhere, one frame
// after another.
type topScreen struct {
	out   io.Writer
	raw   bool
	fd    int
	state *term.State
	quit  chan struct{}
}

func newTopScreen(out io.Writer, plain bool) *topScreen {
	s := &topScreen{out: out}
	f, ok := out.(*os.File)
	if plain || !ok || !term.IsTerminal(int(f.Fd())) || !term.IsTerminal(int(os.Stdin.Fd())) {
		return s
	}
	s.raw, s.fd = true, int(os.Stdin.Fd())
	return s
}

// start puts the terminal in raw mode and returns a context that ends
// when ctx does or a quit key is read.
func (s *topScreen) start(ctx context.Context) context.Context {
	st, err := term.MakeRaw(s.fd)
	if err != nil {
		s.raw = false
		return ctx
	}
	s.state = st
	fmt.Fprint(s.out, "\x1b[?1049h\x1b[?25l") // alternate screen, cursor hidden
	ctx, cancel := context.WithCancel(ctx)
	// The reader ends with the process: a read of the terminal cannot be
	// interrupted, and top is the process's last act.
	go func() {
		defer cancel()
		b := make([]byte, 16)
		for {
			n, err := os.Stdin.Read(b)
			if err != nil {
				return
			}
			for _, c := range b[:n] {
				if c == 'q' || c == 'Q' || c == 3 || c == 4 { // q, Ctrl-C, Ctrl-D
					return
				}
			}
		}
	}()
	return ctx
}

func (s *topScreen) stop() {
	if s.state == nil {
		return
	}
	fmt.Fprint(s.out, "\x1b[?25h\x1b[?1049l")
	_ = term.Restore(s.fd, s.state)
}

func (s *topScreen) frame(text string) error {
	var err error
	if s.raw {
		// Raw mode does not turn \n into \r\n.
		_, err = fmt.Fprint(s.out, "\x1b[H\x1b[2J"+strings.ReplaceAll(text, "\n", "\r\n"))
	} else {
		_, err = fmt.Fprintln(s.out, text)
	}
	if errors.Is(err, os.ErrClosed) {
		return nil
	}
	return err
}
