// Command node-image builds the infermesh node image (see package
// nodeimage) into the local Docker engine unless it is there already, and
// prints its tag. `make node-image` runs it.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/infermesh/infermesh/internal/nodeimage"
	"github.com/infermesh/infermesh/provision"
)

func main() {
	mirror := flag.String("mirror", nodeimage.DefaultMirror, "Debian mirror for debootstrap")
	cache := flag.String("cache-dir", "", "lock and staging directory (default: the user cache dir)")
	quiet := flag.Bool("q", false, "print only the tag")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	cli, err := provision.NewDockerClient()
	if err != nil {
		fmt.Fprintln(os.Stderr, "node-image:", err)
		os.Exit(1)
	}
	defer cli.Close()
	opts := nodeimage.Options{Mirror: *mirror, CacheDir: *cache}
	if !*quiet {
		opts.Log = func(l string) { fmt.Fprintln(os.Stderr, l) }
	}
	tag, err := nodeimage.Ensure(ctx, cli, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "node-image:", err)
		os.Exit(1)
	}
	fmt.Println(tag)
}
