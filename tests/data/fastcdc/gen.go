// Generates golden.txt: chunk lengths that fastcdc-go v0.2.0 (the
// reference's chunker, dataplane.md SNAP-4) cuts from SplitMix64 data.
// Run once with the library on the module path:
//
//	go mod init gen && go mod edit -replace github.com/jotfs/fastcdc-go=<checkout of v0.2.0>
//	go get github.com/jotfs/fastcdc-go && go run gen.go > golden.txt
package main

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"io"

	fastcdc "github.com/jotfs/fastcdc-go"
)

func splitmix(seed uint64, n int) []byte {
	out := make([]byte, 0, n+8)
	s := seed
	var b [8]byte
	for len(out) < n {
		s += 0x9e3779b97f4a7c15
		z := s
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		z ^= z >> 31
		binary.LittleEndian.PutUint64(b[:], z)
		out = append(out, b[:]...)
	}
	return out[:n]
}

func main() {
	cases := [][5]int{
		{1, 12 << 20, 262144, 1 << 20, 4 << 20},
		{2, 1 << 20, 1024, 4096, 16384},
		{3, 2 << 20, 2049, 8192, 4 << 20},
		{4, 65536, 64, 256, 1024},
	}
	fmt.Println("# seed len min avg max lengths... (fastcdc-go v0.2.0, normalisation 2, no seed)")
	for _, c := range cases {
		data := splitmix(uint64(c[0]), c[1])
		ch, err := fastcdc.NewChunker(bytes.NewReader(data), fastcdc.Options{
			MinSize: c[2], AverageSize: c[3], MaxSize: c[4],
		})
		if err != nil {
			panic(err)
		}
		fmt.Printf("%d %d %d %d %d", c[0], c[1], c[2], c[3], c[4])
		for {
			chunk, err := ch.Next()
			if err == io.EOF {
				break
			}
			if err != nil {
				panic(err)
			}
			fmt.Printf(" %d", chunk.Length)
		}
		fmt.Println()
	}
}
