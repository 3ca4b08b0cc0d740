package config

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
)

// Options says where Load reads the configuration from.
type Options struct {
	// Path is the YAML file. Empty means no file: defaults, environment and
	// overrides only.
	Path string
	// LookupEnv resolves ${VAR} references and the DATABASE_URL fallback.
	// Nil means looking up Environ when it is non-nil, else os.LookupEnv.
	LookupEnv func(string) (string, bool)
	// Environ is the environment as "KEY=value" strings, scanned for RELAY_
	// variables. Nil means os.Environ().
	Environ []string
	// Overrides set keys above every other layer, as the CLI's flags do.
	// A key is a path as errors print it ("database_url", "source.mode",
	// "sinks[0].url"; "sinks.0.url" is accepted too); a value is read like a
	// RELAY_ variable's, and an empty one is ignored likewise.
	Overrides map[string]string
	// SinkSecretsOptional is for commands that never send (status, dlq,
	// replay, reconcile, migrate): they need the sinks' names and events,
	// not their credentials. A sink secret (auth.secret, auth.value,
	// auth.password, token, and their *_file keys) whose ${VAR} is unset
	// or whose file cannot be read is then left empty instead of being an
	// error, and a secret the auth type requires is not required.
	SinkSecretsOptional bool
}

// Load reads the configuration in the layers Options describes, reads the
// secrets named by *_file keys, and validates the result.
//
// database_url, when no layer sets it or database_url_file, falls back to
// the DATABASE_URL environment variable; when that is empty too it stays
// empty and pgx uses libpq's PG* variables and defaults.
//
// A missing or unparsable file is reported alone. Otherwise Load returns
// every problem it finds, joined with errors.Join, each naming the key path
// and the file line or variable its value came from; it returns a nil
// Config with any error. Load only reads files and the environment, so it
// is safe to repeat.
func Load(opts Options) (*Config, error) {
	lookup, environ := opts.LookupEnv, opts.Environ
	if environ == nil {
		environ = os.Environ()
	}
	if lookup == nil {
		lookup = os.LookupEnv
		if opts.Environ != nil {
			lookup = lookupIn(opts.Environ)
		}
	}

	t, err := readTree(opts.Path)
	if err != nil {
		return nil, err
	}
	var tolerate func([]string) bool
	if opts.SinkSecretsOptional {
		tolerate = isSinkSecretPath
	}
	errs := t.expandTree(t.root, nil, lookup, tolerate)
	envs, envErrs := envAssignments(environ)
	errs = append(errs, envErrs...)
	errs = append(errs, t.apply(envs)...)
	overrides, overrideErrs := overrideAssignments(opts.Overrides)
	errs = append(errs, overrideErrs...)
	errs = append(errs, t.apply(overrides)...)

	cfg := Default()
	cfg.sinkSecretsOptional = opts.SinkSecretsOptional
	origins, decodeErrs := t.decode(&cfg)
	errs = append(errs, decodeErrs...)
	cfg.origins = origins

	if cfg.Outbox.ConflictsTable == "" {
		cfg.Outbox.ConflictsTable = conflictsTableFor(cfg.Outbox.Table)
	}
	errs = append(errs, cfg.readSecretFiles()...)
	if cfg.DatabaseURL == "" && cfg.DatabaseURLFile == "" {
		if v, ok := lookup("DATABASE_URL"); ok && v != "" {
			cfg.DatabaseURL = Secret(v)
			cfg.origins["database_url"] = "DATABASE_URL"
		}
	}
	if err := cfg.Validate(); err != nil {
		errs = append(errs, err.(interface{ Unwrap() []error }).Unwrap()...)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return &cfg, nil
}

func lookupIn(environ []string) func(string) (string, bool) {
	env := make(map[string]string, len(environ))
	for _, kv := range environ {
		if k, v, ok := strings.Cut(kv, "="); ok {
			env[k] = v
		}
	}
	return func(k string) (string, bool) {
		v, ok := env[k]
		return v, ok
	}
}

// secretRef ties a secret to the key naming a file it may be read from.
type secretRef struct {
	key, fileKey string
	secret       *Secret
	file         string
}

func (c *Config) secretRefs() []secretRef {
	refs := []secretRef{
		{"database_url", "database_url_file", &c.DatabaseURL, c.DatabaseURLFile},
		{"source.standby_url", "source.standby_url_file", &c.Source.StandbyURL, c.Source.StandbyURLFile},
		{"http.metrics_token", "http.metrics_token_file", &c.HTTP.MetricsToken, c.HTTP.MetricsTokenFile},
		{"http.admin_token", "http.admin_token_file", &c.HTTP.AdminToken, c.HTTP.AdminTokenFile},
		{"http.admin_read_token", "http.admin_read_token_file", &c.HTTP.AdminReadToken, c.HTTP.AdminReadTokenFile},
		{"notify.url", "notify.url_file", &c.Notify.URL, c.Notify.URLFile},
		{"notify.auth.secret", "notify.auth.secret_file", &c.Notify.Auth.Secret, c.Notify.Auth.SecretFile},
		{"notify.auth.value", "notify.auth.value_file", &c.Notify.Auth.Value, c.Notify.Auth.ValueFile},
		{"notify.auth.password", "notify.auth.password_file", &c.Notify.Auth.Password, c.Notify.Auth.PasswordFile},
	}
	for i := range c.Sinks {
		p := fmt.Sprintf("sinks[%d].", i)
		a, n := &c.Sinks[i].Webhook.Auth, &c.Sinks[i].NATS
		refs = append(refs,
			secretRef{p + "auth.secret", p + "auth.secret_file", &a.Secret, a.SecretFile},
			secretRef{p + "auth.value", p + "auth.value_file", &a.Value, a.ValueFile},
			secretRef{p + "auth.password", p + "auth.password_file", &a.Password, a.PasswordFile},
			secretRef{p + "token", p + "token_file", &n.Token, n.TokenFile},
		)
	}
	return refs
}

// sinkSecretKeys are the keys of a sink, below sinks[i], that hold a secret
// or name the file it is read from.
var sinkSecretKeys = []string{"auth.secret", "auth.secret_file", "auth.value", "auth.value_file",
	"auth.password", "auth.password_file", "token", "token_file"}

// isSinkSecretPath reports whether path ("sinks", "0", "auth", "value") is
// a sink secret or its *_file key.
func isSinkSecretPath(path []string) bool {
	return len(path) >= 3 && path[0] == "sinks" && isIndex(path[1]) && slices.Contains(sinkSecretKeys, strings.Join(path[2:], "."))
}

// readSecretFiles fills each secret whose *_file key is set from that file,
// without its trailing newline (which editors and `echo` add). With
// sinkSecretsOptional, a sink secret's file is not read.
func (c *Config) readSecretFiles() []error {
	v := validator{origins: c.origins}
	for _, r := range c.secretRefs() {
		if r.file == "" || c.sinkSecretsOptional && strings.HasPrefix(r.key, "sinks[") {
			continue
		}
		if *r.secret != "" {
			v.fail(r.fileKey, "%s is set too; set only one of them", r.key)
			continue
		}
		data, err := os.ReadFile(r.file)
		if err != nil {
			v.fail(r.fileKey, "read secret: %v", err)
			continue
		}
		s, ok := strings.CutSuffix(string(data), "\r\n")
		if !ok {
			s = strings.TrimSuffix(s, "\n")
		}
		*r.secret = Secret(s)
	}
	return v.errs
}
