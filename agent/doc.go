// Package agent is infermeshd: it builds every part from the configuration,
// connects them, and owns their lifecycle (Run: start in order, report
// readiness, drain and stop on cancellation). It is the only package that
// knows all the others; they know nothing of it. The dependency rule is
// cmd -> agent -> {mesh, proxy, provision -> cleanup} -> placement, with
// identity a leaf beside placement.
//
// Where things are:
//
//	agent.go          Agent, Options, New and Run: the order of start-up and shut-down
//	config.go         the YAML configuration: its schema, strict decoding, defaults
//	config_validate.go  its validation, naming the field
//	membership.go     the mesh membership: trust from the config, start, join, leave (package mesh)
//	transport.go      the proxy's remote path over the QUIC transport, and the peer scorer
//	provisioning.go   managed instances: specs from roles, the manager of the Docker and native
//	                  runtimes (package provision), its periodic orphan sweep (package cleanup)
//	nodes.go          node bootstrap: the node manager over the state store, the mesh view, the
//	                  Docker engine and the agent's SSH key (package provision/node); its audit
//	roleserve.go      each role's port (through the proxy) and local upstream: started, moved,
//	                  replaced and retired (its port drained) as the config says
//	health.go         static upstreams: registered in placement only while they answer
//	audit.go          the audit log, fanned out to `infermesh events`
//	admin.go          the admin runtime: state store, admin socket, metrics port
//	backend*.go       the admin API's answers, one file per area (see backend.go)
//	policy.go         run-time policy: the config with the stored overrides on top
//	configdiff.go     what a reload changes, field by field: each field's reload class (its
//	                  `reload` tag), typed changes, and the config in force when some wait
//	reload.go         the parts that apply a reload's changes of their class: trust, roles, instances
//
// Sub-packages: admin (the socket's HTTP API, server and client), metrics
// (Prometheus). The state store is package store, below every package that
// keeps records in it; the agent opens it and hands each part its bucket.
//
// Dev mode (infermeshd -dev) is one node without a mesh whose roles are
// served by an in-process model the caller supplies (Options.DevModel);
// cmd/infermeshd passes the built-in demo model, which this package does
// not link. It passes the same model as Options.Simulated, which serves the
// roles whose instance is runtime simulated, in dev mode or not.
//
// Words: a role is infer.<role>, an OpenAI-compatible endpoint on a
// loopback port; an instance is the model server behind a role on this
// node (a static upstream, or a managed container, native process or
// simulated model); a node is a host in
// the mesh; an override is an operator's run-time policy change, stored so
// that it survives restarts.
package agent
