package metrics

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// InstanceStat is one managed instance as the metrics show it.
type InstanceStat struct {
	Role  string
	State string // provision.InstanceState: pending, pulling, starting, ready, ...
	// Restarts since the agent started supervising it.
	Restarts int
}

// InstanceSource is read at scrape time; the agent adapts its instance
// manager to it. InstanceStats must be safe for concurrent use and must
// not block.
type InstanceSource interface {
	InstanceStats() []InstanceStat
}

var (
	descInstanceState = prometheus.NewDesc("infermesh_instance_state",
		"Managed instances by role and state (1 for the state each is in).", []string{"role", "state"}, nil)
	descInstanceRestarts = prometheus.NewDesc("infermesh_instance_restarts_total",
		"Restarts of a role's managed instance since the agent started.", []string{"role"}, nil)
)

// instanceCollector reads the instance source at scrape time.
type instanceCollector struct {
	src atomic.Pointer[instanceHolder]
}

type instanceHolder struct{ src InstanceSource }

// SetInstances sets (or, with nil, clears) the managed instances read at
// scrape time.
func (m *Metrics) SetInstances(src InstanceSource) {
	if src == nil {
		m.instances.src.Store(nil)
		return
	}
	m.instances.src.Store(&instanceHolder{src: src})
}

func (c *instanceCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descInstanceState
	ch <- descInstanceRestarts
}

func (c *instanceCollector) Collect(ch chan<- prometheus.Metric) {
	h := c.src.Load()
	if h == nil {
		return
	}
	for _, s := range h.src.InstanceStats() {
		ch <- prometheus.MustNewConstMetric(descInstanceState, prometheus.GaugeValue, 1, s.Role, s.State)
		ch <- prometheus.MustNewConstMetric(descInstanceRestarts, prometheus.CounterValue, float64(s.Restarts), s.Role)
	}
}
