// Package configs carries the files of this directory that infermesh
// itself installs, so that what it installs is exactly what is reviewed
// here: the systemd unit a node bootstrap puts on every new node.
package configs

import _ "embed"

// InfermeshdUnit is infermeshd.service, byte for byte.
//
//go:embed infermeshd.service
var InfermeshdUnit []byte
