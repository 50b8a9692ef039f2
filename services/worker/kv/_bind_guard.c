/* Confines the wildcard binds of chosen shared objects (Mooncake's) to one address.
 *
 * The Mooncake Transfer Engine binds its handshake listener and its TCP data acceptor to INADDR_ANY /
 * in6addr_any whatever local_hostname says (transfer_metadata_plugin.cpp, findAvailableTcpPort and
 * SocketHandShakePlugin::startDaemon; tcp_transport_session_impl.h, TcpContext). No flag or MC_*
 * variable of mooncake-transfer-engine 0.3.13 changes that. This module redirects the `bind` imports
 * of the objects it is given (their GOT slots, JUMP_SLOT and GLOB_DAT relocations) to guard_bind, which
 * rewrites a wildcard address to the configured one before calling libc's bind:
 *
 *   AF_INET  0.0.0.0  -> the address (an IPv4 one), or EADDRNOTAVAIL when the address is IPv6
 *   AF_INET6 ::       -> the address, or ::ffff:a.b.c.d when it is IPv4 (a dual-stack socket; a v6-only
 *                        one then fails with EINVAL and the caller falls back to IPv4, as asio does)
 *
 * Any other address, and every bind before set_address, passes through unchanged. In-process and
 * without LD_PRELOAD: objects loaded after `install` are not patched, so it is called after the
 * module that loads them is imported (services/worker/kv/bind_guard.py says when).
 *
 *   install(family, packed_address, path_prefixes) -> number of GOT slots that now point at guard_bind
 *   rewrites() -> how many binds guard_bind has rewritten so far
 *
 * The address is set once per process; install with another one raises ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h> /* first: it defines _GNU_SOURCE, which dl_iterate_phdr needs */
#include <arpa/inet.h>
#include <elf.h>
#include <errno.h>
#include <limits.h>
#include <link.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#if defined(__x86_64__)
#define R_JUMP_SLOT R_X86_64_JUMP_SLOT
#define R_GLOB_DAT R_X86_64_GLOB_DAT
#elif defined(__aarch64__)
#define R_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define R_GLOB_DAT R_AARCH64_GLOB_DAT
#else
#error "_bind_guard: only x86-64 and aarch64 are supported"
#endif

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

static int g_family; /* 0 until set_address; read with acquire after the address is written */
static struct in_addr g_v4;
static struct in6_addr g_v6;
static unsigned long g_rewrites;

static int guard_bind(int fd, const struct sockaddr *addr, socklen_t len) {
    int family = __atomic_load_n(&g_family, __ATOMIC_ACQUIRE);
    if (family == 0 || addr == NULL) return bind(fd, addr, len);
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)addr;
        if (in->sin_addr.s_addr != htonl(INADDR_ANY)) return bind(fd, addr, len);
        if (family != AF_INET) {
            errno = EADDRNOTAVAIL; /* an IPv4 socket cannot take the configured IPv6 address */
            return -1;
        }
        struct sockaddr_in copy = *in;
        copy.sin_addr = g_v4;
        __atomic_add_fetch(&g_rewrites, 1, __ATOMIC_RELAXED);
        return bind(fd, (const struct sockaddr *)&copy, sizeof(copy));
    }
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
        if (!IN6_IS_ADDR_UNSPECIFIED(&in6->sin6_addr)) return bind(fd, addr, len);
        struct sockaddr_in6 copy = *in6;
        if (family == AF_INET6) {
            copy.sin6_addr = g_v6;
        } else {
            memset(&copy.sin6_addr, 0, sizeof(copy.sin6_addr));
            copy.sin6_addr.s6_addr[10] = 0xff;
            copy.sin6_addr.s6_addr[11] = 0xff;
            memcpy(&copy.sin6_addr.s6_addr[12], &g_v4, 4);
        }
        __atomic_add_fetch(&g_rewrites, 1, __ATOMIC_RELAXED);
        return bind(fd, (const struct sockaddr *)&copy, sizeof(copy));
    }
    return bind(fd, addr, len);
}

#define MAX_PREFIXES 16

struct patch_job {
    const char *prefixes[MAX_PREFIXES]; /* UTF-8, owned by the caller's str objects */
    Py_ssize_t count;
    Py_ssize_t hooked;  /* slots pointing at guard_bind after this pass */
    int error;          /* errno of a failed mprotect */
};

/* Whether the object's real path (symbolic links and ".." resolved: RPATH $ORIGIN/../x) starts with a prefix. */
static int wanted(const char *path, const struct patch_job *job) {
    char name[PATH_MAX];
    if (path == NULL || path[0] == '\0' || realpath(path, name) == NULL) return 0;
    for (Py_ssize_t i = 0; i < job->count; i++) {
        if (strncmp(name, job->prefixes[i], strlen(job->prefixes[i])) == 0) return 1;
    }
    return 0;
}

/* The protection a page of the object has now: read-only inside PT_GNU_RELRO (as ld.so rounds it),
 * else its PT_LOAD segment's flags. */
static int page_protection(struct dl_phdr_info *info, uintptr_t page, uintptr_t pagesize) {
    int prot = PROT_READ | PROT_WRITE;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *ph = &info->dlpi_phdr[i];
        uintptr_t start = info->dlpi_addr + ph->p_vaddr;
        if (ph->p_type == PT_GNU_RELRO) {
            uintptr_t lo = start & ~(pagesize - 1), hi = (start + ph->p_memsz) & ~(pagesize - 1);
            if (page >= lo && page < hi) return PROT_READ;
        } else if (ph->p_type == PT_LOAD && page + pagesize > start && page < start + ph->p_memsz) {
            prot = ((ph->p_flags & PF_R) ? PROT_READ : 0) | ((ph->p_flags & PF_W) ? PROT_WRITE : 0) |
                   ((ph->p_flags & PF_X) ? PROT_EXEC : 0);
        }
    }
    return prot;
}

static int write_slot(struct dl_phdr_info *info, void **slot) {
    uintptr_t pagesize = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t page = (uintptr_t)slot & ~(pagesize - 1);
    int prot = page_protection(info, page, pagesize);
    if (!(prot & PROT_WRITE) && mprotect((void *)page, pagesize, PROT_READ | PROT_WRITE) != 0) return errno;
    __atomic_store_n(slot, (void *)guard_bind, __ATOMIC_SEQ_CST);
    if (!(prot & PROT_WRITE) && mprotect((void *)page, pagesize, prot) != 0) return errno;
    return 0;
}

/* d_ptr values: glibc relocates them in place on x86-64 and aarch64; others leave them relative. */
static uintptr_t dyn_address(struct dl_phdr_info *info, ElfW(Addr) value) {
    return value < info->dlpi_addr ? info->dlpi_addr + value : value;
}

static void patch_relocations(struct dl_phdr_info *info, const ElfW(Rela) *rela, size_t bytes,
                              const ElfW(Sym) *symtab, const char *strtab, struct patch_job *job) {
    for (size_t i = 0; i < bytes / sizeof(ElfW(Rela)) && job->error == 0; i++) {
        unsigned long type = ELF64_R_TYPE(rela[i].r_info);
        if (type != R_JUMP_SLOT && type != R_GLOB_DAT) continue;
        const ElfW(Sym) *sym = &symtab[ELF64_R_SYM(rela[i].r_info)];
        if (strcmp(strtab + sym->st_name, "bind") != 0) continue;
        void **slot = (void **)(info->dlpi_addr + rela[i].r_offset);
        if (*slot != (void *)guard_bind) job->error = write_slot(info, slot);
        if (job->error == 0) job->hooked++;
    }
}

static int patch_object(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct patch_job *job = data;
    if (!wanted(info->dlpi_name, job)) return 0;
    const ElfW(Dyn) *dyn = NULL;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) dyn = (const ElfW(Dyn) *)(info->dlpi_addr + info->dlpi_phdr[i].p_vaddr);
    }
    if (dyn == NULL) return 0;
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *jmprel = NULL, *rela = NULL;
    size_t jmprel_bytes = 0, rela_bytes = 0;
    int pltrel_is_rela = 1;
    for (; dyn->d_tag != DT_NULL; dyn++) {
        switch (dyn->d_tag) {
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)dyn_address(info, dyn->d_un.d_ptr); break;
        case DT_STRTAB: strtab = (const char *)dyn_address(info, dyn->d_un.d_ptr); break;
        case DT_JMPREL: jmprel = (const ElfW(Rela) *)dyn_address(info, dyn->d_un.d_ptr); break;
        case DT_PLTRELSZ: jmprel_bytes = dyn->d_un.d_val; break;
        case DT_PLTREL: pltrel_is_rela = dyn->d_un.d_val == DT_RELA; break;
        case DT_RELA: rela = (const ElfW(Rela) *)dyn_address(info, dyn->d_un.d_ptr); break;
        case DT_RELASZ: rela_bytes = dyn->d_un.d_val; break;
        default: break;
        }
    }
    if (symtab == NULL || strtab == NULL) return 0;
    if (jmprel != NULL && pltrel_is_rela) patch_relocations(info, jmprel, jmprel_bytes, symtab, strtab, job);
    if (rela != NULL) patch_relocations(info, rela, rela_bytes, symtab, strtab, job);
    return job->error != 0; /* stop at the first failure */
}

static int set_address(int family, const Py_buffer *packed) {
    int current = __atomic_load_n(&g_family, __ATOMIC_ACQUIRE);
    if (family == AF_INET && packed->len == 4) {
        if (current == AF_INET && memcmp(&g_v4, packed->buf, 4) == 0) return 0;
        if (current != 0) goto other;
        memcpy(&g_v4, packed->buf, 4);
    } else if (family == AF_INET6 && packed->len == 16) {
        if (current == AF_INET6 && memcmp(&g_v6, packed->buf, 16) == 0) return 0;
        if (current != 0) goto other;
        memcpy(&g_v6, packed->buf, 16);
    } else {
        PyErr_SetString(PyExc_ValueError, "family must be AF_INET with 4 bytes or AF_INET6 with 16 bytes");
        return -1;
    }
    __atomic_store_n(&g_family, family, __ATOMIC_RELEASE);
    return 0;
other:
    PyErr_SetString(PyExc_ValueError, "the bind guard is already set to another address in this process");
    return -1;
}

static PyObject *install(PyObject *self, PyObject *args) {
    (void)self;
    int family;
    Py_buffer packed;
    PyObject *prefixes;
    if (!PyArg_ParseTuple(args, "iy*O!", &family, &packed, &PyTuple_Type, &prefixes)) return NULL;
    struct patch_job job = {.count = PyTuple_GET_SIZE(prefixes)};
    int failed = job.count > MAX_PREFIXES;
    if (failed) PyErr_Format(PyExc_ValueError, "at most %d path prefixes", MAX_PREFIXES);
    for (Py_ssize_t i = 0; i < job.count && !failed; i++) {
        PyObject *item = PyTuple_GET_ITEM(prefixes, i);
        job.prefixes[i] = PyUnicode_Check(item) ? PyUnicode_AsUTF8(item) : NULL;
        failed = job.prefixes[i] == NULL || job.prefixes[i][0] != '/';
        if (failed && !PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "path_prefixes must be absolute paths");
    }
    if (!failed) failed = set_address(family, &packed);
    PyBuffer_Release(&packed);
    if (failed) return NULL;
    dl_iterate_phdr(patch_object, &job);
    if (job.error != 0) {
        errno = job.error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(job.hooked);
}

static PyObject *rewrites(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyLong_FromUnsignedLong(__atomic_load_n(&g_rewrites, __ATOMIC_RELAXED));
}

static PyMethodDef methods[] = {
    {"install", install, METH_VARARGS, "install(family, packed_address, path_prefixes) -> GOT slots hooked"},
    {"rewrites", rewrites, METH_NOARGS, "rewrites() -> wildcard binds rewritten so far"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_bind_guard", NULL, -1, methods};

PyMODINIT_FUNC PyInit__bind_guard(void) { return PyModule_Create(&module); }
