package provision

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/docker/docker/api/types/container"
)

// deviceRequests maps GPUs to the engine's device requests, as docker run
// --gpus does: "all" is every GPU (count -1), a number is that many, a
// comma-separated list names devices by index or UUID.
func (r *Resources) deviceRequests() ([]container.DeviceRequest, error) {
	g := strings.TrimSpace(r.GPUs)
	if g == "" {
		return nil, nil
	}
	req := container.DeviceRequest{Capabilities: [][]string{{"gpu"}}}
	if g == "all" {
		req.Count = -1
	} else if n, err := strconv.Atoi(g); err == nil {
		if n < 1 {
			return nil, fmt.Errorf("gpus %q: a count is at least 1", g)
		}
		req.Count = n
	} else {
		for _, id := range strings.Split(g, ",") {
			id = strings.TrimSpace(id)
			if id == "" {
				return nil, fmt.Errorf("gpus %q: an empty device id", g)
			}
			req.DeviceIDs = append(req.DeviceIDs, id)
		}
	}
	return []container.DeviceRequest{req}, nil
}

// apply sets r on a container's host config.
func (r *Resources) apply(hc *container.HostConfig) error {
	if r == nil {
		return nil
	}
	drs, err := r.deviceRequests()
	if err != nil {
		return err
	}
	hc.DeviceRequests = drs
	hc.ShmSize = r.ShmSize
	hc.Memory = r.Memory
	hc.NanoCPUs = r.NanoCPUs
	return nil
}
