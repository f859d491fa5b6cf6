// Package provision runs the inference instances an infermesh agent manages
// and defines the provider contract that node bootstrap plugs into.
//
// Three layers, each usable on its own:
//
//   - The provider contract (Provider, NodeSpec, Observation, Event): how a
//     runtime acquires, adopts and releases one concrete node attempt. The
//     rules carried over from the reference design: attempt id 0 is reserved
//     for an unbound template; a selected offer is authoritative (never
//     substituted); PrepareMissingBootstrap never creates a resource; the
//     provider ref of a spec is derivable without provider state; StopBySpec
//     of something already gone is success (false, nil).
//   - DockerProvider: the contract over a Docker engine. Containers get a
//     deterministic name and io.infermesh.* ownership labels, publish their
//     port on 127.0.0.1 only, and are only ever removed after their labels
//     were re-checked client-side (fail closed).
//   - Manager: turns the roles' desired instances into running, probed,
//     supervised containers registered in placement. Intent is written to the
//     IntentStore before any container is created, so an agent crash at any
//     point leaves something to adopt or to clean up.
package provision
