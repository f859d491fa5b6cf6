package provision

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"reflect"
	"testing"

	"github.com/docker/docker/api/types/container"
)

// TestDockerResourcesOnTheEngine: gpus, shm_size, memory and cpus reach
// the created container's host config as docker run's flags would set
// them. The container is created, not started: this machine has no GPU,
// and the engine checks device requests only at start.
func TestDockerResourcesOnTheEngine(t *testing.T) {
	t.Parallel()
	_, cli, p := engineProvider(t)
	tests := []struct {
		name string
		r    Resources
		want []container.DeviceRequest
	}{
		{"all gpus", Resources{GPUs: "all", ShmSize: 8 << 30, Memory: 32 << 30, NanoCPUs: 1e9},
			[]container.DeviceRequest{{Count: -1, Capabilities: [][]string{{"gpu"}}}}},
		{"a count", Resources{GPUs: "2"}, []container.DeviceRequest{{Count: 2, Capabilities: [][]string{{"gpu"}}}}},
		{"device ids", Resources{GPUs: "0, GPU-3a1b"}, []container.DeviceRequest{{DeviceIDs: []string{"0", "GPU-3a1b"}, Capabilities: [][]string{{"gpu"}}}}},
		{"limits only", Resources{Memory: 1 << 30, NanoCPUs: 5e8}, nil},
	}
	for i, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := tt.r
			spec := ProvisionSpec{AttemptID: 1, InstanceID: uint64(100 + i), Image: testImage, Role: "res", Ports: []int{8080}, Resources: &r}
			spec.Role = "res" + string(rune('a'+i))
			h, err := p.CreateInstance(context.Background(), spec, nil)
			if err != nil {
				t.Fatal(err)
			}
			info, err := cli.ContainerInspect(context.Background(), h.ResourceID)
			if err != nil {
				t.Fatal(err)
			}
			hc := info.HostConfig
			var got []container.DeviceRequest
			for _, d := range hc.DeviceRequests {
				d.Options = nil // the engine may fill an empty map
				got = append(got, d)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("device requests = %+v, want %+v", got, tt.want)
			}
			if hc.ShmSize != r.ShmSize && !(r.ShmSize == 0 && hc.ShmSize == 64<<20) {
				t.Errorf("shm size = %d, want %d", hc.ShmSize, r.ShmSize)
			}
			if hc.Memory != r.Memory || hc.NanoCPUs != r.NanoCPUs {
				t.Errorf("memory, nano cpus = %d, %d; want %d, %d", hc.Memory, hc.NanoCPUs, r.Memory, r.NanoCPUs)
			}
		})
	}
}

func TestResourcesRejected(t *testing.T) {
	for _, g := range []string{"0", "-1", "1,,2"} {
		spec := ProvisionSpec{AttemptID: 1, Image: "x", Resources: &Resources{GPUs: g}}
		if err := spec.Validate(); err == nil {
			t.Errorf("gpus %q validated", g)
		}
	}
	if err := (ProvisionSpec{AttemptID: 1, Image: "x", Resources: &Resources{Memory: -1}}).Validate(); err == nil {
		t.Error("a negative memory limit validated")
	}
	native := ProvisionSpec{AttemptID: 1, Runtime: RuntimeNative, Command: "/bin/x", Ports: []int{1}, Resources: &Resources{GPUs: "all"}}
	if err := native.Validate(); err == nil {
		t.Error("a native spec with container resources validated")
	}
	// A spec without resources hashes as before resources existed (the
	// content hashed then, computed here as it was), so running containers
	// are adopted across the upgrade, not replaced.
	plain := ProvisionSpec{AttemptID: 1, Image: "x", Role: "r", Args: []string{"a"}, Ports: []int{8080}}
	old, _ := json.Marshal(struct {
		Role    string   `json:"role"`
		Image   string   `json:"image"`
		Env     []EnvVar `json:"env"`
		Args    []string `json:"args"`
		Mounts  []Mount  `json:"mounts"`
		Ports   []int    `json:"ports"`
		Runtime string   `json:"runtime,omitempty"`
		Command string   `json:"command,omitempty"`
	}{plain.Role, plain.Image, plain.Env, plain.Args, plain.Mounts, plain.Ports, plain.Runtime, plain.Command})
	sum := sha256.Sum256(old)
	if got, want := plain.Hash(), hex.EncodeToString(sum[:8]); got != want {
		t.Errorf("hash of a resource-less spec = %s, want %s as before", got, want)
	}
	withGPU := plain
	withGPU.Resources = &Resources{GPUs: "all"}
	if withGPU.Hash() == plain.Hash() {
		t.Error("adding GPUs does not change the spec hash: the container would not be replaced")
	}
}
