package nats

import "github.com/outbox-relay/outbox-relay/relay"

// Unexported functions under test.
var (
	SanitizeSubjectToken   = sanitizeSubjectToken
	ClassifyAckError       = classifyAckError
	ClassifyPublishError   = classifyPublishError
	ValidatePublishSubject = validatePublishSubject
	SubjectCovers          = subjectCovers
)

// MaxSubjectLen is the longest subject a message is published to.
const MaxSubjectLen = maxSubjectLen

// RenderSubject renders e's subject with the template text.
func RenderSubject(text string, e *relay.Event) (string, error) {
	st, err := parseSubjectTemplate(text)
	if err != nil {
		return "", err
	}
	subject, err := st.render(e)
	if err != nil {
		return "", err
	}
	return subject, validatePublishSubject(subject)
}

// SubjectPattern returns the filter matching every subject text renders.
func SubjectPattern(text string) (string, error) {
	st, err := parseSubjectTemplate(text)
	if err != nil {
		return "", err
	}
	return st.pattern()
}

// RenderSubjectBothWays renders e's subject with the template text by
// concatenation (fast reports whether the template allows it) and through
// text/template, for comparison.
func RenderSubjectBothWays(text string, e *relay.Event) (concat, executed string, fast bool, err error) {
	st, err := parseSubjectTemplate(text)
	if err != nil {
		return "", "", false, err
	}
	if concat, err = st.render(e); err != nil {
		return "", "", false, err
	}
	fast = st.parts != nil
	st.parts = nil
	executed, err = st.render(e)
	return concat, executed, fast, err
}

// SubjectRenderer parses text once and returns its render function; slow
// forces text/template.
func SubjectRenderer(text string, slow bool) (func(*relay.Event) (string, error), error) {
	st, err := parseSubjectTemplate(text)
	if err != nil {
		return nil, err
	}
	if slow {
		st.parts = nil
	}
	return st.render, nil
}
