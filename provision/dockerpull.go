package provision

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"time"

	cerrdefs "github.com/containerd/errdefs"
	"github.com/docker/docker/api/types/image"
	"github.com/docker/docker/client"
)

// ImageAPI is the Docker client's image calls the provider uses to pull a
// missing image (*client.Client has them). A DockerAPI without them cannot
// pull: a missing image is then ErrImageNotFound at once.
type ImageAPI interface {
	ImageInspect(ctx context.Context, imageID string, opts ...client.ImageInspectOption) (image.InspectResponse, error)
	ImagePull(ctx context.Context, ref string, options image.PullOptions) (io.ReadCloser, error)
}

var _ ImageAPI = (*client.Client)(nil)

// ImageEnsurer is implemented by providers whose instances come from an
// image that may have to be fetched first. The Manager calls EnsureImage
// before creating an instance, under its own (long) timeout: a large image
// takes longer than any other operation.
type ImageEnsurer interface {
	// EnsureImage makes spec's image present on the host, pulling it when
	// missing and reporting progress to sink (ObsProvider lines). An image
	// that cannot be had is ErrImageNotFound.
	EnsureImage(ctx context.Context, spec ProvisionSpec, sink Sink) error
}

var _ ImageEnsurer = (*DockerProvider)(nil)

func imageNotFound(img string, err error) error {
	return fmt.Errorf("%w: %s (docker pull %s, or build it locally under that name): %w", ErrImageNotFound, img, img, err)
}

// EnsureImage implements ImageEnsurer.
func (p *DockerProvider) EnsureImage(ctx context.Context, spec ProvisionSpec, sink Sink) error {
	if sink == nil {
		sink = Discard
	}
	ia, ok := p.api.(ImageAPI)
	if !ok {
		return nil // create says so when it is missing
	}
	ref := p.ProviderRef(spec)
	cctx, cancel := p.callCtx(ctx)
	_, err := ia.ImageInspect(cctx, spec.Image)
	cancel()
	switch {
	case err == nil:
		return nil
	case client.IsErrConnectionFailed(err):
		return wrap("inspect image", spec.Image, err)
	case !cerrdefs.IsNotFound(err):
		return wrap("inspect image", spec.Image, err)
	}
	p.emit(sink, spec, ref, ObsProvider, "image "+spec.Image+" is not on this host: pulling it")
	rc, err := ia.ImagePull(ctx, spec.Image, image.PullOptions{})
	if err != nil {
		if client.IsErrConnectionFailed(err) {
			return wrap("pull image", spec.Image, err)
		}
		return imageNotFound(spec.Image, err)
	}
	defer rc.Close()
	if err := pullProgress(rc, time.Now, func(line string) { p.emit(sink, spec, ref, ObsProvider, line) }); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("pull image %s: %w", spec.Image, ctx.Err())
		}
		return imageNotFound(spec.Image, err)
	}
	p.emit(sink, spec, ref, ObsProvider, "pulled image "+spec.Image)
	return nil
}

// pullMessage is one line of the engine's pull stream.
type pullMessage struct {
	Status   string `json:"status"`
	ID       string `json:"id"`
	Progress string `json:"progress"`
	Error    string `json:"error"`
}

// pullProgress reads the pull stream to its end and reports what an
// operator wants to see: each layer's change of status, and a progress bar
// at most every few seconds per layer. An error message in the stream is
// the pull's error.
func pullProgress(r io.Reader, now func() time.Time, report func(string)) error {
	dec := json.NewDecoder(r)
	type layer struct {
		status string
		last   time.Time
	}
	layers := map[string]*layer{}
	for {
		var m pullMessage
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("pull stream: %w", err)
		}
		if m.Error != "" {
			return errors.New(m.Error)
		}
		l := layers[m.ID]
		if l == nil {
			l = &layer{}
			layers[m.ID] = l
		}
		t := now()
		switch {
		case m.Status != l.status:
			l.status, l.last = m.Status, t
		case m.Progress != "" && t.Sub(l.last) >= 3*time.Second:
			l.last = t
		default:
			continue
		}
		line := "pull: " + m.Status
		if m.ID != "" {
			line = "pull: " + m.ID + ": " + m.Status
		}
		if m.Progress != "" {
			line += " " + m.Progress
		}
		report(line)
	}
}
