// Writes reference.tar: the tar the reference agent's walker makes of a
// tree (dataplane.md SNAP-3: every path under the root, sorted by bytes,
// tar.FileInfoHeader, the relative name with "/" for directories, mtime
// truncated to seconds, no access or change time, PAX format). Run once,
// as root, on the tree the_tar_is_what_the_reference_writes builds:
//
//	ZT_KEEP_GO_TREE=/tmp/go-tree cargo test --lib the_tar_is_what_the_reference_writes
//	go run gen.go /tmp/go-tree > reference.tar
package main

import (
	"archive/tar"
	"io"
	"os"
	"path/filepath"
	"sort"
	"time"
)

func main() {
	root := os.Args[1]
	var paths []string
	err := filepath.Walk(root, func(p string, _ os.FileInfo, err error) error {
		if err != nil || p == root {
			return err
		}
		rel, err := filepath.Rel(root, p)
		paths = append(paths, filepath.ToSlash(rel))
		return err
	})
	if err != nil {
		panic(err)
	}
	sort.Strings(paths)
	tw := tar.NewWriter(os.Stdout)
	for _, rel := range paths {
		full := filepath.Join(root, rel)
		fi, err := os.Lstat(full)
		if err != nil {
			panic(err)
		}
		link := ""
		if fi.Mode()&os.ModeSymlink != 0 {
			if link, err = os.Readlink(full); err != nil {
				panic(err)
			}
		}
		hdr, err := tar.FileInfoHeader(fi, link)
		if err != nil {
			panic(err)
		}
		hdr.Name = rel
		if fi.IsDir() {
			hdr.Name += "/"
		}
		hdr.ModTime = hdr.ModTime.Truncate(time.Second)
		hdr.AccessTime, hdr.ChangeTime = time.Time{}, time.Time{}
		hdr.Format = tar.FormatPAX
		if err := tw.WriteHeader(hdr); err != nil {
			panic(err)
		}
		if fi.Mode().IsRegular() {
			f, err := os.Open(full)
			if err != nil {
				panic(err)
			}
			if _, err := io.Copy(tw, f); err != nil {
				panic(err)
			}
			f.Close()
		}
	}
	if err := tw.Close(); err != nil {
		panic(err)
	}
}
