// Command rowrite is a tiny static test program for the provision package's
// engine tests: it writes a file at the path given as its only argument and
// exits 0, or prints why it could not to stderr and exits 3. Run inside a
// container, it shows whether a bind mount is writable.
package main

import (
	"fmt"
	"os"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: rowrite PATH")
		os.Exit(2)
	}
	if err := os.WriteFile(os.Args[1], []byte("written\n"), 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "write failed:", err)
		os.Exit(3)
	}
	fmt.Println("wrote", os.Args[1])
}
