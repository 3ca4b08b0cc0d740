package console

import (
	"embed"
	"io/fs"
	"net/http"
)

// page is the console: one HTML page, its style sheet and its script,
// plain and without a build step. It holds no data: it asks the API for
// everything, with the token the operator types into it, which it keeps
// in sessionStorage (gone with the tab) and sends as a header.
//
//go:embed page
var page embed.FS

// pageHandler serves the console under /console/. The policy allows only
// the page's own files and requests to its own origin: no inline script,
// no other site, no framing.
func pageHandler() http.Handler {
	files, err := fs.Sub(page, "page")
	if err != nil {
		panic(err) // the embedded directory is part of the build
	}
	fileServer := http.StripPrefix("/console/", http.FileServerFS(files))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "no-referrer")
		h.Set("X-Frame-Options", "DENY")
		h.Set("Cache-Control", "no-cache")
		fileServer.ServeHTTP(w, r)
	})
}
