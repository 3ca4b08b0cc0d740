-- The role's privileges, as run needs them and as doctor reports them
-- (docs/security.md, "a least-privilege role"). Every statement only
-- reads.

-- name: PrivilegesRole
SELECT rolname, rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user;

-- name: PrivilegesOnTable
-- Whether the role may use the schema of table $1 (a quoted name), and
-- has each table privilege of $2, in its order. No row when the table does
-- not exist.
SELECT has_schema_privilege(c.relnamespace, 'USAGE'),
       array(SELECT has_table_privilege(c.oid, p.name) FROM unnest($2::text[]) WITH ORDINALITY AS p(name, i) ORDER BY p.i)
  FROM pg_class c WHERE c.oid = to_regclass($1);

-- name: PrivilegesOnTableOwned
-- PrivilegesOnTable with the table's owner and whether the role owns it.
SELECT has_schema_privilege(c.relnamespace, 'USAGE'), pg_get_userbyid(c.relowner),
       -- a superuser is a member of every role; it owns only what it owns
       CASE WHEN r.rolsuper THEN c.relowner = r.oid ELSE pg_has_role(c.relowner, 'MEMBER') END,
       array(SELECT has_table_privilege(c.oid, p.name) FROM unnest($2::text[]) WITH ORDINALITY AS p(name, i) ORDER BY p.i)
  FROM pg_class c, pg_roles r WHERE c.oid = to_regclass($1) AND r.rolname = current_user;
