// s3server: an S3-compatible server for kvpilot's tests of s3://BUCKET/PREFIX model
// sources, gofakes3 (github.com/johannesboyne/gofakes3, MIT) behind two test hooks:
//
//   - /_kvpilot/stats: JSON {"object_bytes_served", "get_object_requests",
//     "throttle_bytes_per_sec"}, counting GET object responses with status 200/206 and the
//     body bytes actually written to their connections (so a test can tell a resumed
//     download from a restarted one);
//   - /_kvpilot/throttle?bps=N (GET or POST): the rate of GET object bodies, 0 = unlimited.
//
// "_kvpilot" is not a valid bucket name (no underscores), so these paths never shadow S3.
//
// Authentication: gofakes3 does not check request signatures at all; any access key and
// secret are accepted (clients still sign, so tests use a key pair as they would on S3). It
// only rejects an x-amz-date more than 15 minutes from its clock.
//
// Storage: with --root, objects are plain files under ROOT/buckets/<bucket>/<key> (gofakes3's
// s3afero backend) and a GET streams from the file, seeking for a Range; without it they
// live in memory (s3mem). Only path-style addressing (http://HOST:PORT/bucket/key) is served.
package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3afero"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:9000", "HOST:PORT to listen on (0.0.0.0 for pods in a local cluster)")
	root := flag.String("root", "", "keep objects as files under this folder (created if missing); empty: in memory")
	bps := flag.Int64("throttle-bytes-per-sec", 0, "rate of GET object bodies, shared by all downloads; 0: unlimited")
	verbose := flag.Bool("verbose", false, "log every S3 request, not only errors")
	flag.Parse()

	var backend gofakes3.Backend = s3mem.New()
	if *root != "" {
		fs, err := s3afero.FsPath(*root, s3afero.FsPathCreateAll)
		if err == nil {
			backend, err = s3afero.MultiBucket(fs)
		}
		if err != nil {
			log.Fatalf("s3server: --root %s: %v", *root, err)
		}
	}
	levels := []gofakes3.LogLevel{gofakes3.LogErr, gofakes3.LogWarn}
	if *verbose {
		levels = append(levels, gofakes3.LogInfo)
	}
	s := &server{s3: gofakes3.New(backend, gofakes3.WithLogger(gofakes3.StdLog(log.Default(), levels...))).Server()}
	s.bps.Store(*bps)

	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatalf("s3server: %v", err)
	}
	// The test harness polls /_kvpilot/stats for readiness; this line is for people.
	fmt.Printf("s3server listening on http://%s\n", ln.Addr())
	srv := &http.Server{Handler: s, ReadHeaderTimeout: 30 * time.Second}
	log.Fatal(srv.Serve(ln))
}

type server struct {
	s3          http.Handler
	bytesServed atomic.Int64
	getRequests atomic.Int64
	bps         atomic.Int64

	mu       sync.Mutex
	linkFree time.Time // when the shared, throttled link has sent everything reserved so far
}

func (s *server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.URL.Path == "/_kvpilot/stats":
		s.writeStats(w)
	case r.URL.Path == "/_kvpilot/throttle":
		v, err := strconv.ParseInt(r.URL.Query().Get("bps"), 10, 64)
		if err != nil || v < 0 {
			http.Error(w, "bps must be an integer >= 0", http.StatusBadRequest)
			return
		}
		s.bps.Store(v)
		s.mu.Lock()
		s.linkFree = time.Time{} // the new rate applies from now, not after the old backlog
		s.mu.Unlock()
		s.writeStats(w)
	case isGetObject(r):
		ow := &objectWriter{ResponseWriter: w, s: s}
		s.s3.ServeHTTP(ow, r)
		ow.begin(http.StatusOK) // an empty body writes nothing: net/http then sends 200
	default:
		s.s3.ServeHTTP(w, r)
	}
}

func (s *server) writeStats(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]int64{
		"object_bytes_served":    s.bytesServed.Load(),
		"get_object_requests":    s.getRequests.Load(),
		"throttle_bytes_per_sec": s.bps.Load(),
	})
}

// isGetObject mirrors gofakes3's routing: GET /bucket/key without the query keys that route
// elsewhere (multipart uploads, versioning, version listing).
func isGetObject(r *http.Request) bool {
	if r.Method != http.MethodGet {
		return false
	}
	bucket, key, _ := strings.Cut(strings.TrimPrefix(r.URL.Path, "/"), "/")
	if bucket == "" || key == "" {
		return false
	}
	q := r.URL.Query()
	for _, k := range []string{"uploadId", "uploads", "versioning", "versions"} {
		if q.Has(k) {
			return false
		}
	}
	return true
}

// pace blocks until n more bytes may go out at the current rate. One schedule for all
// responses, so concurrent (e.g. parallel ranged) downloads share the rate as on one link.
func (s *server) pace(n int) {
	bps := s.bps.Load()
	if bps <= 0 {
		return
	}
	s.mu.Lock()
	now := time.Now()
	if s.linkFree.Before(now) {
		s.linkFree = now // an idle link saves up no burst
	}
	s.linkFree = s.linkFree.Add(time.Duration(float64(n) / float64(bps) * float64(time.Second)))
	until := s.linkFree
	s.mu.Unlock()
	time.Sleep(time.Until(until))
}

// objectWriter counts (and paces) the body of one GET object response.
type objectWriter struct {
	http.ResponseWriter
	s      *server
	status int
}

func (w *objectWriter) begin(status int) {
	if w.status == 0 {
		w.status = status
		if status == http.StatusOK || status == http.StatusPartialContent {
			w.s.getRequests.Add(1)
		}
	}
}

func (w *objectWriter) WriteHeader(status int) {
	w.begin(status)
	if status == http.StatusPartialContent {
		// gofakes3 replays the x-amz-* headers of the PUT, so a Range GET would carry the
		// whole object's x-amz-checksum-crc32 and boto3 (>= 1.36 validates by default) would
		// reject the part. S3 sends no full-object checksum with a range: neither do we.
		for k := range w.Header() {
			if strings.HasPrefix(k, "X-Amz-Checksum-") {
				w.Header().Del(k)
			}
		}
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *objectWriter) Write(b []byte) (int, error) {
	w.begin(http.StatusOK)
	if w.status != http.StatusOK && w.status != http.StatusPartialContent {
		return w.ResponseWriter.Write(b) // an error document, not object bytes
	}
	written := 0
	for len(b) > 0 {
		// Small slices when throttled (about 20 ms each) so the rate is smooth and a
		// throttle change takes effect quickly.
		n := len(b)
		if bps := w.s.bps.Load(); bps > 0 {
			n = min(n, int(max(1, min(bps/50, 64<<10))))
		}
		w.s.pace(n)
		m, err := w.ResponseWriter.Write(b[:n])
		written += m
		w.s.bytesServed.Add(int64(m))
		if err != nil {
			return written, err
		}
		b = b[n:]
	}
	return written, nil
}
