package store

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"runtime/debug"

	"go.etcd.io/bbolt"
)

// A state store can be damaged under the agent: a disk that filled up, a
// copy that stopped half-way, an editor, a bad block. bbolt trusts its file:
// a truncated one faults (SIGBUS) when its memory map is read past the end,
// garbage over the freelist panics, and garbage over the newest meta page
// makes it fall back to the previous transaction without a word. So Open
// checks the file before bbolt sees it, opens and walks it with faults
// turned into errors, and compares its policy with the mirror (mirror.go).

// ErrCorrupt is wrapped by the errors of a store file that is damaged.
var ErrCorrupt = errors.New("state store is corrupt")

// CorruptError names the damaged file and what is wrong with it.
type CorruptError struct {
	Path string
	Why  string
}

func (e *CorruptError) Error() string {
	return fmt.Sprintf("state store %s is corrupt: %s", e.Path, e.Why)
}

func (e *CorruptError) Unwrap() error { return ErrCorrupt }

// The on-disk layout bbolt documents in its internal/common package: every
// page starts with a 16-byte header; pages 0 and 1 hold a meta each, the
// newer (higher txid) of the two valid ones being the database's state.
const (
	boltMagic      = 0xED0CDAED
	boltVersion    = 2
	pageHeaderSize = 16
	metaSize       = 64 // magic..txid (56 bytes) + checksum
	metaSumSize    = 56 // the checksum covers every field before it
)

type boltMeta struct {
	pageSize uint32
	freelist uint64
	pgid     uint64 // the high-water mark: pages [0, pgid) are in the file
	txid     uint64
}

// parseMeta decodes and verifies one meta page (b starts at the page).
func parseMeta(b []byte) (boltMeta, error) {
	if len(b) < pageHeaderSize+metaSize {
		return boltMeta{}, errors.New("short page")
	}
	m := b[pageHeaderSize : pageHeaderSize+metaSize]
	le := binary.LittleEndian
	if le.Uint32(m[0:]) != boltMagic {
		return boltMeta{}, errors.New("bad magic")
	}
	if v := le.Uint32(m[4:]); v != boltVersion {
		return boltMeta{}, fmt.Errorf("version %d", v)
	}
	h := fnv.New64a()
	_, _ = h.Write(m[:metaSumSize])
	if h.Sum64() != le.Uint64(m[metaSumSize:]) {
		return boltMeta{}, errors.New("checksum mismatch")
	}
	ps := le.Uint32(m[8:])
	if ps < 512 || ps > 1<<16 || ps&(ps-1) != 0 {
		return boltMeta{}, fmt.Errorf("page size %d", ps)
	}
	return boltMeta{pageSize: ps, freelist: le.Uint64(m[32:]), pgid: le.Uint64(m[40:]), txid: le.Uint64(m[48:])}, nil
}

// checkFile verifies what bbolt would trust blindly: both meta pages are
// intact (one that is not may hide the newest transaction) and the file
// holds every page they say it has (a shorter one faults when mapped).
// The file must exist and not be empty.
func checkFile(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return fmt.Errorf("state store %s: %w", path, err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return fmt.Errorf("state store %s: %w", path, err)
	}
	size := st.Size()
	head := make([]byte, pageHeaderSize+metaSize)
	if _, err := io.ReadFull(f, head); err != nil {
		return &CorruptError{path, fmt.Sprintf("%d bytes: shorter than a meta page", size)}
	}
	m0, err0 := parseMeta(head)
	ps := int64(os.Getpagesize())
	if err0 == nil {
		ps = int64(m0.pageSize)
	}
	page1 := make([]byte, pageHeaderSize+metaSize)
	if _, err := f.ReadAt(page1, ps); err != nil {
		return &CorruptError{path, fmt.Sprintf("%d bytes: truncated before meta page 1", size)}
	}
	m1, err1 := parseMeta(page1)
	switch {
	case err0 != nil:
		return &CorruptError{path, "meta page 0: " + err0.Error()}
	case err1 != nil:
		return &CorruptError{path, "meta page 1: " + err1.Error()}
	case m0.pageSize != m1.pageSize:
		return &CorruptError{path, fmt.Sprintf("meta pages disagree on the page size (%d, %d)", m0.pageSize, m1.pageSize)}
	}
	high := max(m0.pgid, m1.pgid)
	if want := int64(high) * ps; size < want {
		return &CorruptError{path, fmt.Sprintf("truncated: %d bytes, its pages need %d", size, want)}
	}
	// bbolt reads the freelist of the newer meta while opening, before
	// anything can catch a panic of its own (the file lock it took would
	// stay held), so the freelist is checked here.
	m := m0
	if m1.txid > m0.txid {
		m = m1
	}
	if err := checkFreelist(f, m, ps); err != nil {
		return &CorruptError{path, "freelist: " + err.Error()}
	}
	return nil
}

const (
	freelistPageFlag = 0x10
	noFreelist       = ^uint64(0) // bbolt's NoFreelistSync
)

// checkFreelist verifies the freelist page of m: its header and every id
// in it, which must be a page of the file.
func checkFreelist(f *os.File, m boltMeta, ps int64) error {
	if m.freelist == noFreelist {
		return nil
	}
	if m.freelist < 2 || m.freelist >= m.pgid {
		return fmt.Errorf("page %d out of range", m.freelist)
	}
	hdr := make([]byte, pageHeaderSize+8)
	if _, err := f.ReadAt(hdr, int64(m.freelist)*ps); err != nil {
		return err
	}
	le := binary.LittleEndian
	id, flags := le.Uint64(hdr), le.Uint16(hdr[8:])
	count, overflow := uint64(le.Uint16(hdr[10:])), uint64(le.Uint32(hdr[12:]))
	if id != m.freelist || flags != freelistPageFlag {
		return fmt.Errorf("page %d has id %d, flags %#x", m.freelist, id, flags)
	}
	start := int64(pageHeaderSize)
	if count == 0xFFFF {
		count = le.Uint64(hdr[pageHeaderSize:])
		start += 8
	}
	if m.freelist+overflow >= m.pgid || uint64(start)+count*8 > (overflow+1)*uint64(ps) {
		return fmt.Errorf("page %d: %d ids over %d pages do not fit", m.freelist, count, overflow+1)
	}
	ids := make([]byte, count*8)
	if _, err := f.ReadAt(ids, int64(m.freelist)*ps+start); err != nil {
		return err
	}
	for i := range count {
		if p := le.Uint64(ids[i*8:]); p < 2 || p >= m.pgid {
			return fmt.Errorf("free page id %d out of range", p)
		}
	}
	return nil
}

// guard runs f with memory faults turned into panics and every panic into
// an error: bbolt reading a damaged file must not take the agent down.
func guard(path string, f func() error) (err error) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		debug.SetPanicOnFault(true)
		defer func() {
			if r := recover(); r != nil {
				err = &CorruptError{path, fmt.Sprintf("reading it failed: %v", r)}
			}
		}()
		err = f()
	}()
	<-done
	return err
}

// checkDB walks every page of db (bbolt's consistency check) under guard.
func checkDB(path string, db *bbolt.DB) error {
	return guard(path, func() error {
		return db.View(func(tx *bbolt.Tx) error {
			var errs []error
			for err := range tx.Check() {
				errs = append(errs, err)
			}
			if len(errs) > 0 {
				return &CorruptError{path, errors.Join(errs...).Error()}
			}
			return nil
		})
	})
}
