// Package configs carries the files of this directory that infermesh
// itself installs, so that what it installs is exactly what is reviewed
// here: the systemd unit a node bootstrap puts on every new node.
package configs

import _ "embed"

// InfermeshdUnit is infermeshd.service, byte for byte.
//
//go:embed infermeshd.service
var InfermeshdUnit []byte

// Sysusers is infermesh.sysusers, byte for byte: installed as
// /etc/sysusers.d/infermesh.conf.
//
//go:embed infermesh.sysusers
var Sysusers []byte

// User is the user (and group) the unit runs as and Sysusers declares.
const User = "infermesh"

// AdminGroup is the group Sysusers declares for the operators who may use
// the admin socket (admin.group), with User in it.
const AdminGroup = "infermesh-admin"
