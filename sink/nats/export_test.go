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
